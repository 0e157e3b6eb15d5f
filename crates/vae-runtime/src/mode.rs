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
    /// Spatial shard over a 2-D grid of blocks, with halo exchange along both axes (corners
    /// included; not in the specification, which lets families add spatial strategies).
    SpatialShard2d,
    /// A video decoder's layers cut into stages, one per rank, each latent frame passed from
    /// stage to stage (video decode only; not in the specification, which lets families add
    /// strategies).
    Pipeline,
}

impl ParallelMode {
    /// Every mode, in the order the CLI lists them.
    pub const ALL: [ParallelMode; 6] = [
        Self::Tile,
        Self::Auto,
        Self::SpatialShardHeight,
        Self::SpatialShardWidth,
        Self::SpatialShard2d,
        Self::Pipeline,
    ];

    /// The name used in flags and configs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tile => "tile",
            Self::Auto => "auto",
            Self::SpatialShardHeight => "spatial_shard_height",
            Self::SpatialShardWidth => "spatial_shard_width",
            Self::SpatialShard2d => "spatial_shard_2d",
            Self::Pipeline => "pipeline",
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
#[error(
    "unknown VAE parallel mode {0:?} (expected tile, auto, spatial_shard_height, spatial_shard_width, spatial_shard_2d or pipeline)"
)]
pub struct UnknownMode(pub String);

impl FromStr for ParallelMode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, UnknownMode> {
        Self::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| UnknownMode(s.to_string()))
    }
}

/// What a request runs as, once a model family's policy has resolved its [`ParallelMode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Tile-parallel (or one direct tile below the tile size).
    Tile,
    /// Spatial shard along the axis.
    Shard(vae_planner::ShardAxis),
    /// Spatial shard over an `[R, C]` grid of blocks.
    Shard2d([usize; 2]),
    /// Pipeline stages over latent frames.
    Pipeline,
}

/// A family's decision for one request, with its reason for the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StrategyChoice {
    /// What runs.
    pub strategy: Strategy,
    /// Why, in words (goes into the request report).
    pub reason: String,
    /// True when a forced mode could not be honoured and the request fell back to tile (the
    /// caller logs it once as a warning).
    pub fallback: bool,
}

impl StrategyChoice {
    /// The requested strategy runs.
    pub fn chosen(strategy: Strategy, reason: impl Into<String>) -> Self {
        Self { strategy, reason: reason.into(), fallback: false }
    }

    /// A forced mode falls back to tile.
    pub fn fallback_to_tile(reason: impl Into<String>) -> Self {
        Self { strategy: Strategy::Tile, reason: reason.into(), fallback: true }
    }

    /// A forced shard mode's choice along `axis`: the shard when `fit` is `Ok` (or the input is
    /// malformed, `well_formed` false: the shard path's input check then names the problem),
    /// tiles flagged as a fallback with the reason otherwise. `verb` says what the tiles do
    /// ("decoding").
    pub fn forced_shard(
        mode: ParallelMode,
        axis: vae_planner::ShardAxis,
        fit: Result<(), String>,
        well_formed: bool,
        verb: &str,
    ) -> Self {
        match fit {
            Err(why) if well_formed => Self::fallback_to_tile(format!("{mode}: {why}; {verb} with tiles")),
            _ => Self::chosen(Strategy::Shard(axis), format!("{mode} requested")),
        }
    }

    /// A forced 2-D shard's choice for an `h × w` input (in whole units) over `ranks` ranks,
    /// for a network whose widest halo is `halo` units (`[rows, columns]`, at least 1): the grid
    /// whose blocks are closest to square ([`vae_planner::square_grid`]) among those that give
    /// every block at least that along both axes; tiles flagged as a fallback otherwise. `verb`
    /// says what the tiles do ("decoding").
    pub fn forced_blocks_of(h: usize, w: usize, ranks: usize, halo: [usize; 2], verb: &str) -> Self {
        let mode = ParallelMode::SpatialShard2d;
        match vae_planner::square_grid(ranks, h, w, [halo[0].max(1), halo[1].max(1)]) {
            Some(grid) => Self::chosen(
                Strategy::Shard2d(grid),
                format!("{mode} requested: {} × {} blocks, the closest to square", grid[0], grid[1]),
            ),
            None => Self::fallback_to_tile(format!(
                "{mode}: {ranks} rank(s) cannot cut a {h}x{w} input into a grid of blocks of at least {} × {} each; {verb} with tiles",
                halo[0].max(1),
                halo[1].max(1)
            )),
        }
    }

    /// A forced 2-D shard of an input of `dims`, its height and width last (of another
    /// number of dimensions than `ndim`, malformed: it goes to the shard path, whose input
    /// check names it): [`Self::forced_blocks_of`] on the extent in units of `unit` rows and
    /// columns (a decode's latent: 1; an encode's video or image: the encoder's spatial
    /// factor), every block at least `min_block` units along both axes; tiles, flagged as a
    /// fallback, where the extent is not whole units. `what` names the input ("an image"),
    /// `verb` what the tiles do ("encoding").
    pub fn forced_blocks_in_units(
        what: &str,
        dims: &[usize],
        ndim: usize,
        unit: usize,
        ranks: usize,
        min_block: [usize; 2],
        verb: &str,
    ) -> Self {
        let mode = ParallelMode::SpatialShard2d;
        let unit = unit.max(1);
        match *dims {
            [.., h, w] if dims.len() == ndim && h % unit == 0 && w % unit == 0 => {
                Self::forced_blocks_of(h / unit, w / unit, ranks, min_block, verb)
            }
            [.., h, w] if dims.len() == ndim => Self::fallback_to_tile(format!(
                "{mode}: {what} of {h}x{w} is not whole latent rows and columns of {unit}; {verb} with tiles"
            )),
            _ => Self::chosen(Strategy::Shard2d([1, ranks.max(1)]), format!("{mode} requested")),
        }
    }

    /// `auto`'s choice of axis for an `h × w` input: the longer axis of those `fits` accepts
    /// (width on ties), or tiles with the reason the height does not fit when neither does.
    /// `what` names the input in the reason ("a 60x104 latent").
    pub fn auto_axis(
        h: usize,
        w: usize,
        what: &str,
        fits: impl Fn(vae_planner::ShardAxis) -> Result<(), String>,
    ) -> Self {
        use vae_planner::ShardAxis::{Height, Width};
        let axis = match (fits(Height), fits(Width)) {
            (Ok(()), Ok(())) if h > w => Height,
            (_, Ok(())) => Width,
            (Ok(()), Err(_)) => Height,
            (Err(why), Err(_)) => return Self::chosen(Strategy::Tile, format!("auto: {why}; tiles")),
        };
        Self::chosen(Strategy::Shard(axis), format!("auto: {axis} of {what}, the exact untiled result"))
    }
}

/// Whether an `axis` extent of `extent` rows cuts into `ranks` bands of whole units of `unit`
/// rows, one unit at least each; why not, naming the input as `what` ("an image"), when not.
pub fn whole_bands(
    what: &str,
    axis: vae_planner::ShardAxis,
    extent: usize,
    unit: usize,
    ranks: usize,
) -> Result<(), String> {
    let unit = unit.max(1);
    if !extent.is_multiple_of(unit) {
        return Err(format!("{what} {axis} of {extent} is not a multiple of {unit} (whole latent rows)"));
    }
    if !vae_planner::BandPartition::fits(extent / unit, ranks, 1) {
        return Err(format!("{what} {axis} of {extent} cannot give {ranks} rank(s) a latent row each"));
    }
    Ok(())
}
