//! A cost model: each strategy's latency and per-rank peak memory for one request, predicted
//! from the network's layer shapes and a device's calibration constants, so that `auto` can
//! choose the fastest strategy that fits a memory cap and `vae-parallel plan` can show the
//! choice without running it.
//!
//! * [`network`]: the forward pass as shaped steps, which a family builds from its config.
//! * [`profile`]: a device's constants (convolution rates per shape, element-wise and link
//!   rates), measured by `vae-parallel calibrate`.
//! * [`kernels`]: what a CPU convolution call holds besides its maps (packed or transformed
//!   weights, working buffers).
//! * [`predict`](mod@predict): the figures of a strategy (direct, tiles, bands, blocks).

pub mod kernels;
pub mod network;
pub mod predict;
pub mod profile;

pub use network::{Network, NetworkBuilder, Step, StepKind};
pub use predict::{Layout, Placement, Prediction, RankPrediction, predict};
pub use profile::{ConvRate, DeviceKind, DeviceProfile};
