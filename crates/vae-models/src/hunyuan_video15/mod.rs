//! diffusers' `AutoencoderKLHunyuanVideo15` (HunyuanVideo-1.5): a causal 3-D VAE whose convs
//! pad by replicating edges (two frames in front, a row and column each side), whose norms are
//! per-pixel RMS norms, whose mid blocks attend over the whole clip with a frame-causal mask,
//! and whose resamples fold 2 × 2 (× 2) blocks into channels (DCAE) with averaged or repeated
//! shortcuts. Plain, tiled and tile-parallel decode and encode, exactly as diffusers runs them
//! (a batch as `enable_slicing()` runs it: diffusers' unsliced batched call fails), and the
//! plain decode and encode sharded along H or W.
//!
//! Policy of this family: every mode but the pipeline, which cannot apply (the attention needs
//! every frame at once); `auto` shards the longer axis over two ranks or more (its norms are per
//! pixel, so a band needs nothing from the others but its halo rows); decoded pixels go to the
//! owner, encoded latents to every rank; latents are scaled by `scaling_factor` only.

mod config;
mod cost;
mod family;
mod layers;
mod model;
mod networks;
mod operators;
mod tiling;

pub use config::HunyuanVideo15Config;
pub use family::FAMILY;
pub use model::{CLASS_NAME, HunyuanVideo15Vae};
pub use operators::{HunyuanVideo15Operator, HunyuanVideo15ShardOperator};
pub use tiling::HunyuanVideo15Tiling;
