//! diffusers' `AutoencoderKLWan` (Wan2.1, Wan2.2) and `AutoencoderKLQwenImage` (the Wan2.1
//! architecture with its own policy): causal 3-D decode one latent frame per decoder call, and
//! encode one chunk of frames per encoder call, with a per-request feature cache, exactly as
//! diffusers runs them; plain, tiled (tile-parallel), spatial-shard (bands or a 2-D grid),
//! pipelined and streamed decode; plain, tiled and spatial-shard encode.
//!
//! Policy of this family: every parallel mode (its RMS norms are per pixel, so a band needs
//! no statistics from the others); `auto` shards the longer latent axis that gives every rank
//! a band at least as wide as the widest halo (or runs what the cost model predicts fastest);
//! decoded pixels go to the owner for Wan and to every rank for Qwen-Image, encoded latents to
//! every rank.

mod cache;
mod config;
mod cost;
mod decoder;
mod encoder;
mod family;
mod layers;
mod model;
mod operators;
mod policy;
mod resample;
mod stage;

pub use config::WanConfig;
pub use family::FAMILY;
pub use model::{VideoVaeClass, WanVae};
pub use operators::{
    WanDecodeOperator, WanEncodeOperator, WanPipelineDecodeOperator, WanShardDecodeOperator, WanShardEncodeOperator,
};
