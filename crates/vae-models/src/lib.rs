//! VAE families. Each family (AutoencoderKL for SD / FLUX.1 / Z-Image, FLUX.2, Wan2.1/2.2 and
//! Qwen-Image, HunyuanVideo-1.5, LTX-Video and LTX-2) is one folder that mirrors diffusers' module tree and weight names and owns the
//! family's *policy*: which parallel modes it supports, how it picks one per request, its tile
//! geometry, and who receives the output. [`family`] is the interface they implement and the
//! registry that finds one by `_class_name`; shared crates below only provide mechanism.
//!
//! Families: [`autoencoder_kl`] (AutoencoderKL and AutoencoderKLFlux2), [`wan`] (Wan2.1,
//! Wan2.2 and Qwen-Image), [`hunyuan_video15`] (HunyuanVideo-1.5) and [`ltx`] (LTX-Video 0.9.5+
//! and LTX-2). All load onto the CPU or a CUDA device.

pub mod autoencoder_kl;
mod checks;
mod clip;
mod error;
pub mod family;
pub mod hunyuan_video15;
pub mod layers;
pub mod ltx;
mod placement;
pub mod wan;
pub mod weights;

pub use error::{ModelError, Result};
pub use family::{CostNetworks, Direction, Execution, FamilySpec, LoadedVae, TileOverrides};
pub use placement::ResultsOnDevice;
