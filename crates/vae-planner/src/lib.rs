//! Pure planning for distributed VAE encode/decode.
//!
//! Diffusion-model VAEs (AutoencoderKL, Wan, Qwen-Image, ...) decode large
//! latents tile by tile. To spread those tiles over several ranks and still
//! reproduce HuggingFace diffusers bit for bit, every rank must agree on:
//!
//! * the tile geometry diffusers uses ([`tiling`]): which input ranges are
//!   tiles, how much neighbouring outputs blend, what is kept and where it
//!   lands;
//! * the blend weights and their rounding ([`blend`]);
//! * who runs which tile ([`balance`]), decided identically everywhere
//!   without communication;
//! * the executor's task/grid description ([`grid`]);
//! * for spatial-shard decode, the band each rank holds and the halo widths ([`bands`]),
//!   or its block of a 2-D grid ([`blocks`]), and which of its convolutions overlap their
//!   halo exchange with their compute ([`overlap`]);
//! * for a pipeline over frames, the layers each rank runs ([`stages`]).
//!
//! This crate is deliberately pure: no tensors, no I/O, no threads. It is
//! plain integer (and a little f64) arithmetic, so it can be tested
//! exhaustively and linked by any tensor backend.
//!
//! ```
//! use vae_planner::{AutoencoderKlTiling, lpt_assign, workloads};
//!
//! // Z-Image: 1024-px tiles, 4 decoder blocks (8x upscale), 1152x1152 image.
//! let kl = AutoencoderKlTiling::from_config(1024, 4);
//! let layout = kl.decode_layout(144, 144, 8)?;
//! assert_eq!(layout.grid_shape(), [2, 2]);
//! assert_eq!(layout.output_shape(), [1152, 1152]);
//!
//! let tasks = layout.to_tasks(|tile| tile.input.clone());
//! let plan = lpt_assign(&workloads(&tasks), 2)?;
//! assert_eq!(plan.per_rank, vec![vec![0], vec![1, 2, 3]]);
//! # Ok::<(), vae_planner::PlanError>(())
//! ```

pub mod balance;
pub mod bands;
pub mod blend;
pub mod blocks;
pub mod cost;
pub mod error;
pub mod grid;
pub mod overlap;
pub mod stages;
pub mod tiling;

pub use balance::{Assignment, lpt_assign};
pub use bands::{BandPartition, ShardAxis, halo_width};
pub use blend::{BlendRamp, blend_value};
pub use blocks::{BlockGrid, parse_grid, square_grid};
pub use error::PlanError;
pub use grid::{GridCoord, GridSpec, TileTask, grid_shape_from_last, workloads};
pub use overlap::{interior, overlap_pays};
pub use stages::StagePartition;
pub use tiling::{
    AutoencoderKlTiling, AxisMerge, AxisPlan, AxisTiling, CropSegment, MergeRule, Tile2d, TileLayout2d, WanTiling,
};
