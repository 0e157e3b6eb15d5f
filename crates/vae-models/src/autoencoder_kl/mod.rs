//! diffusers' `AutoencoderKL` (Stable Diffusion 1.x/2.x/XL/3.x, FLUX.1, Z-Image) and
//! `AutoencoderKLFlux2` (FLUX.2): the same encoder and decoder; FLUX.2 adds a separate decoder
//! width and a latent batch-norm that its pipeline uses for (de)normalisation.
//!
//! Policy of this family: tiles, and on the CPU spatial shards along either axis and over a 2-D
//! grid (its GroupNorm statistics summed exactly over the ranks, on the host: on CUDA a forced
//! shard mode is a typed error and `auto` keeps tiles); no pipeline (an image has no frames);
//! diffusers' tile geometry and routing; decoded pixels go to the owner for AutoencoderKL and to
//! every rank for FLUX.2, encoded latents to every rank.

mod config;
mod cost;
mod family;
mod model;
mod operator;

pub use config::{AutoencoderKlConfig, KlVariant};
pub use family::FAMILY;
pub use model::{AutoencoderKl, Decoder, Encoder, LatentBatchNorm, patchify2x2, unpatchify2x2};
pub use operator::{KlOperator, KlShardOperator, KlTask};
