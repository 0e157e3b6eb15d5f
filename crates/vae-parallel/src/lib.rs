//! vae-parallel: spread the VAE encode/decode of diffusion models over ranks — threads, processes
//! or GPUs — and get the same pixels one device would.
//!
//! This facade re-exports the layers and adds what a program needs around them: starting a
//! group of ranks ([`group`]; a local group's ranks each on a thread pool of its own,
//! [`local_ranks`]) and turning per-rank reports into a request report ([`report`]).
//! The `vae-parallel` binary is built on it.
//!
//! Layers, bottom up: [`transport`] (collectives), [`tensor`] (tensors and ops), [`planner`]
//! (pure tile geometry and balancing), [`runtime`] (the distributed executor), [`models`] (VAE
//! families and their policies).

pub mod cost;
pub mod engine;
pub mod group;
pub mod io;
pub mod local_ranks;
pub mod output;
pub mod report;
pub mod stream_out;
pub mod video;

pub use vae_models as models;
pub use vae_planner as planner;
pub use vae_runtime as runtime;
pub use vae_tensor as tensor;
pub use vae_transport as transport;
