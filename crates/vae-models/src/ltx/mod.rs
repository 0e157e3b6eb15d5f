//! diffusers' `AutoencoderKLLTXVideo` (LTX-Video 0.9.5 and later) and `AutoencoderKLLTX2Video`
//! (LTX-2): 3-D VAEs that fold 4 × 4 pixel patches into channels (width offset before height),
//! whose encoder is causal in time and whose decoder (non-causal in the published configs, with
//! reflect padding in LTX-2's) may be conditioned on a timestep; resamples fold 2 × 2 (× 2)
//! blocks into channels with averaged shortcuts on the way down and unfold them with repeated
//! shortcuts on the way up; norms are per-pixel RMS norms without weights; there is no
//! attention. Plain, tiled over H and W, tiled over frames (diffusers' framewise path) and
//! tile-parallel decode and encode, exactly as diffusers runs them, and the plain decode and
//! encode sharded along H or W.
//!
//! Policy of this family: every mode but the pipeline (the decoder reads the next frame at every
//! conv); `auto` shards the longer axis over two ranks or more unless the frames are tiled;
//! decoded pixels go to the owner, encoded latents to every rank; latents are normalised with the
//! `latents_mean` / `latents_std` the checkpoint stores, and the decode timestep is a model
//! setting (0, the pipelines' default, until set).

mod config;
mod cost;
mod family;
mod layers;
mod model;
mod networks;
mod operators;
mod tiling;

pub use config::{DownLevel, LtxClass, LtxConfig, SpatialPadding, Stride, UpLevel};
pub use family::FAMILY;
pub use model::LtxVae;
pub use operators::{LtxMerge, LtxOperator, LtxShardOperator, LtxTile};
pub use tiling::{Dropped, LtxTiling, TemporalMerge};
