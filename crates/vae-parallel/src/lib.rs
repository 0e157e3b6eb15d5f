//! vae-parallel: spread the VAE encode/decode of diffusion models over ranks — threads, processes
//! or GPUs — and get the same pixels one device would.
//!
//! Two types carry the library: a [`Vae`] (a diffusers VAE directory, loaded once) and a
//! [`Group`] (the ranks its requests run on). A request's options are a [`Decode`] or an
//! [`Encode`]; every failure is an [`Error`] whose [`kind`](Error::kind) says what went wrong.
//!
//! ```
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/autoencoder_kl/sd_like");
//! use vae_parallel::{Decode, Device, Group, Tensor, Vae};
//!
//! let vae = Vae::load(dir)?;                                   // or Vae::builder(dir).dtype(..).build()?
//! let group = Group::local(4)?;                                // or Group::from_env()?
//! let latent = Tensor::seeded_uniform([1, 4, 32, 32], 0, -1.0, 1.0, &Device::Cpu)?;
//! let image = group.decode(&vae, &latent, &Decode::default())?; // Some(pixels) on the owner
//! assert_eq!(image.unwrap().dims(), &[1, 3, 256, 256]);
//! # Ok::<(), vae_parallel::Error>(())
//! ```
//!
//! The `cli` feature (on by default) builds the `vae-parallel` command on the same API; turn it
//! off to link the library alone. Process-wide settings: [`init`]. The layers underneath, bottom
//! up: [`transport`] (collectives), [`tensor`] (tensors and ops), [`planner`] (tile geometry,
//! balancing, the cost model), [`runtime`] (the distributed executor), [`models`] (the VAE
//! families and their policies).

#[cfg(feature = "candle")]
pub mod candle;
#[cfg(feature = "cli")]
pub mod cli;
pub mod config;
pub mod cost;
pub mod error;
pub mod group;
pub mod io;
pub mod launch;
pub mod local_ranks;
pub mod options;
pub mod output;
pub mod report;
pub mod settings;
pub mod stream_out;
pub mod vae;
pub mod video;

pub use config::{Config, init, trim_recycled};
pub use error::{Error, ErrorKind, Result};
pub use group::{CancelToken, Finished, Group, LocalGroupBuilder, Request};
pub use options::{Decode, Encode, EncodeOutput, Options, Tiling};
pub use report::RequestReport;
pub use vae::{CostProfile, Vae, VaeBuilder};
pub use vae_models::TileOverrides;
pub use vae_runtime::{FrameSink, OutputPlacement, ParallelMode, SinkError};
pub use vae_tensor::{DType, Device, Tensor};

pub use vae_models as models;
pub use vae_planner as planner;
pub use vae_runtime as runtime;
pub use vae_tensor as tensor;
pub use vae_transport as transport;
