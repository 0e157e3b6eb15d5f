//! The parallel mode a request asks for. Shared code only parses and carries it; each model
//! family decides what it supports and how it falls back.

use std::fmt;
use std::str::FromStr;

/// `--vae-parallel-mode`, as the specification names the values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ParallelMode {
    /// Tile-parallel: whole overlapping tiles dealt to ranks (the exact feature-off path).
    #[default]
    Tile,
    /// Let the model family choose per request.
    Auto,
    /// Spatial shard along the height, with halo exchange.
    SpatialShardHeight,
    /// Spatial shard along the width, with halo exchange.
    SpatialShardWidth,
}

impl ParallelMode {
    /// Every mode, in the order the CLI lists them.
    pub const ALL: [ParallelMode; 4] = [Self::Tile, Self::Auto, Self::SpatialShardHeight, Self::SpatialShardWidth];

    /// The name used in flags and configs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tile => "tile",
            Self::Auto => "auto",
            Self::SpatialShardHeight => "spatial_shard_height",
            Self::SpatialShardWidth => "spatial_shard_width",
        }
    }
}

impl fmt::Display for ParallelMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown mode name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown VAE parallel mode {0:?} (expected tile, auto, spatial_shard_height or spatial_shard_width)")]
pub struct UnknownMode(pub String);

impl FromStr for ParallelMode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, UnknownMode> {
        Self::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| UnknownMode(s.to_string()))
    }
}
