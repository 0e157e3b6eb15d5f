//! diffusers' `AutoencoderKLWan` (Wan2.1) and `AutoencoderKLQwenImage` (same decoder): causal 3-D decode, one latent frame per decoder call
//! with a per-request feature cache, exactly as diffusers runs it. So far the plain (untiled)
//! and tiled (tile-parallel through [`WanDecodeOperator`]) decode of Wan2.1-style models (no
//! residual blocks, no patchify); Wan2.2, encode and Qwen-Image come next.

mod model;

pub use model::{VideoVaeClass, WanConfig, WanDecodeOperator, WanEncodeOperator, WanShardDecodeOperator, WanVae};
