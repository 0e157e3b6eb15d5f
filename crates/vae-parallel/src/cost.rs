//! The cost model on a loaded model ([`vae_planner::cost`]): the strategies a request could
//! run, each one's predicted latency and per-rank peak memory, and `auto`'s choice under a
//! memory cap. `vae-parallel plan` prints the same table without running anything.
//!
//! The device's constants come from a profile file `vae-parallel calibrate` wrote, or on a CPU
//! nobody calibrated from the built-in ones scaled by a first-use probe ([`probe`]), which
//! times a few kernels with the code `calibrate` uses ([`measure`]).

pub mod measure;
pub mod probe;

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use vae_models::{CostNetworks, Direction, LoadedVae};
use vae_planner::cost::{DeviceKind, DeviceProfile, Layout, Placement, Prediction, predict};
use vae_runtime::{ParallelMode, Strategy};

use crate::launch::TransportKind;
use crate::options::Tiling;
use crate::report::human_bytes;

/// Errors of the cost model.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    /// No strategy's predicted peak fits the cap.
    #[error(
        "no strategy fits `max_memory_per_rank` {cap}: the smallest predicted peak per rank is {smallest} ({strategy}); {advice}",
        cap = human_bytes(*cap), smallest = human_bytes(*smallest)
    )]
    NothingFits {
        /// The cap, bytes.
        cap: u64,
        /// The smallest predicted peak, bytes.
        smallest: u64,
        /// The strategy that has it.
        strategy: String,
        /// What would fit: more ranks or smaller tiles.
        advice: String,
    },
    /// The family has no cost model for this input.
    #[error("{class} has no cost model for an input of {dims:?}: `max_memory_per_rank` needs one")]
    NoModel {
        /// The diffusers class.
        class: String,
        /// The input's shape.
        dims: Vec<usize>,
    },
    /// A memory cap on a model loaded without a cost model.
    #[error("`max_memory_per_rank` needs the cost model's settings (a device profile)")]
    NoProfile,
    /// A profile file could not be read or parsed, or holds impossible constants.
    #[error("device profile {path}: {message}")]
    Profile {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// A size could not be read.
    #[error("{text:?} is not a size ({reason}; e.g. 512M, 2G, 1.5GiB)")]
    Size {
        /// What was given.
        text: String,
        /// Why it is not a size.
        reason: String,
    },
    /// Rank 0, which decides for the group, found nothing that fits the cap.
    #[error("rank 0 found no strategy that fits `max_memory_per_rank` (its error says which)")]
    RefusedByOwner,
}

/// What the cost model needs beyond the model and the request: the device's constants and how
/// the ranks share the cores. (The memory cap is the request's:
/// [`Options::max_memory_per_rank`](crate::Options::max_memory_per_rank).)
#[derive(Debug, Clone, PartialEq)]
pub struct CostSettings {
    /// The device's calibration constants.
    pub profile: DeviceProfile,
    /// Compute threads per rank and ranks per host.
    pub placement: Placement,
}

/// One strategy a request could run, with its prediction.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The strategy.
    pub strategy: Strategy,
    /// Whether the request tiles (one rank: tiles rather than the direct pass).
    pub use_tiling: bool,
    /// Its name in tables and reports (`direct`, `tile`, `shard-height`, `shard-2x2`, ...).
    pub label: String,
    /// What the model predicts.
    pub prediction: Prediction,
}

/// The strategies a `direction` request on an `input_dims` input over `ranks` ranks could run
/// on `model` (what its policy accepts without falling back; on one rank with `use_tiling`,
/// tiles only), each predicted; None when the family has no cost model for the input. A
/// strategy the model cannot predict (a grid that does not cut the latent) is left out.
pub fn candidates(
    model: &dyn LoadedVae,
    direction: Direction,
    input_dims: &[usize],
    ranks: usize,
    tiling: Tiling,
    settings: &CostSettings,
) -> Option<Vec<Candidate>> {
    let nets = networks(model, direction, input_dims, settings)?;
    // The exact untiled strategies a group of `ranks` can run: shards along either axis or
    // over a grid, where the family has them for this input.
    let shards = || {
        [ParallelMode::SpatialShardHeight, ParallelMode::SpatialShardWidth, ParallelMode::SpatialShard2d]
            .into_iter()
            .filter(|mode| model.check_mode(*mode).is_ok())
            .map(|mode| model.strategy(direction, mode, input_dims, ranks))
            .filter(|choice| !choice.fallback && choice.strategy != Strategy::Tile)
            .map(|choice| (choice.strategy, true))
            .collect::<Vec<_>>()
    };
    let mut options = Vec::new();
    match tiling {
        // The untiled pixels: the direct pass on one rank, or a shard.
        Tiling::Off => {
            options.push((Strategy::Tile, false));
            if ranks > 1 {
                options.extend(shards());
            }
        }
        // diffusers' tiled pixels: tiles (the direct pass where the input fits one).
        Tiling::On => options.push((Strategy::Tile, !nets.tiles.is_empty())),
        // The reference's semantics: one rank tiles only when the request asks for it
        // (`vae_use_tiling`) or the cap needs it; several ranks tile, or shard.
        Tiling::Reference { asked } if ranks <= 1 => {
            if !asked || nets.tiles.is_empty() {
                options.push((Strategy::Tile, false));
            }
            if !nets.tiles.is_empty() {
                options.push((Strategy::Tile, true));
            }
        }
        Tiling::Reference { .. } => {
            options.push((Strategy::Tile, true));
            options.extend(shards());
        }
    }
    let out = options
        .into_iter()
        .filter_map(|(strategy, use_tiling)| {
            let prediction = predict_on(&nets, strategy, use_tiling, ranks, settings)?;
            Some(Candidate { strategy, use_tiling, label: label(&nets, strategy, use_tiling), prediction })
        })
        .collect();
    Some(out)
}

/// The prediction for one strategy (a 2-D grid named by the request included); None where the
/// family has no cost model for the input or the strategy is not modelled (the pipeline).
pub fn predict_strategy(
    model: &dyn LoadedVae,
    direction: Direction,
    input_dims: &[usize],
    ranks: usize,
    strategy: Strategy,
    use_tiling: bool,
    settings: &CostSettings,
) -> Option<Prediction> {
    predict_on(&networks(model, direction, input_dims, settings)?, strategy, use_tiling, ranks, settings)
}

/// The model's passes for the request, their maps in the element type of the profile's device
/// where it decides it (a GPU profile measured in bf16 predicts bf16 maps, wherever `plan`
/// runs).
fn networks(
    model: &dyn LoadedVae,
    direction: Direction,
    input_dims: &[usize],
    settings: &CostSettings,
) -> Option<CostNetworks> {
    let mut nets = model.cost_networks(direction, input_dims)?;
    if let Some(bytes) = settings.profile.map_bytes() {
        for net in std::iter::once(&mut nets.whole).chain(&mut nets.tiles) {
            net.elem_bytes = bytes;
        }
    }
    Some(nets)
}

fn predict_on(
    nets: &CostNetworks,
    strategy: Strategy,
    use_tiling: bool,
    ranks: usize,
    settings: &CostSettings,
) -> Option<Prediction> {
    let layout = match strategy {
        // Without tiling (one rank computes), or an input that fits one tile: the direct pass.
        Strategy::Tile if !use_tiling || nets.tiles.is_empty() => Layout::Direct,
        Strategy::Tile => Layout::Tiles { tiles: &nets.tiles, ranks, stitched: nets.stitched },
        Strategy::Shard(axis) => Layout::Bands { axis, ranks },
        Strategy::Shard2d(grid) => Layout::Blocks { grid },
        Strategy::Pipeline => return None,
    };
    predict(&nets.whole, layout, settings.placement, &settings.profile)
        .map_err(|e| tracing::debug!(?strategy, "not predicted: {e}"))
        .ok()
}

/// A strategy's name in tables: `direct`, `tile`, `shard-height`, `shard-2x2`.
fn label(nets: &CostNetworks, strategy: Strategy, use_tiling: bool) -> String {
    match strategy {
        Strategy::Tile if !use_tiling || nets.tiles.is_empty() => "direct".into(),
        Strategy::Tile => format!("tile ({})", nets.tiles.len()),
        Strategy::Shard(axis) => format!("shard-{axis}"),
        Strategy::Shard2d([r, c]) => format!("shard-{r}x{c}"),
        Strategy::Pipeline => "pipeline".into(),
    }
}

/// Where the cost model places `ranks` ranks linked by `transport`, each process with
/// `threads` compute threads, on a `kind` device: CPU ranks share a host's cores (a local rank
/// on a pool of its own, [`crate::local_ranks::local_placement`]; a rank process on its own
/// threads, `ranks_per_host` to a host); NCCL ranks have a GPU each, the others share the one
/// they compute on.
pub fn placement(
    kind: DeviceKind,
    transport: TransportKind,
    threads: usize,
    ranks: usize,
    ranks_per_host: Option<usize>,
) -> Placement {
    match kind {
        DeviceKind::Cpu if transport.is_multi_process() => {
            crate::local_ranks::host_placement(threads, ranks_per_host.unwrap_or(ranks))
        }
        DeviceKind::Cpu => crate::local_ranks::local_placement(Some(threads), ranks),
        DeviceKind::Cuda => {
            let sharing = if transport == TransportKind::Nccl { 1 } else { ranks.max(1) };
            Placement { threads_per_rank: 1.0 / sharing as f64, ranks_per_host: sharing, threads_alone: 1.0 }
        }
    }
}

/// The candidate for `strategy` run with `use_tiling` (or, for a strategy that does not
/// depend on it, the one listed).
pub fn prediction_of(candidates: &[Candidate], strategy: Strategy, use_tiling: bool) -> Option<&Candidate> {
    candidates
        .iter()
        .find(|c| c.strategy == strategy && c.use_tiling == use_tiling)
        .or_else(|| candidates.iter().find(|c| c.strategy == strategy))
}

/// `auto`'s choice: the fastest candidate whose predicted peak fits `cap` (any without one);
/// when none fits, an error naming the smallest peak and what would fit.
pub fn choose(candidates: &[Candidate], cap: Option<u64>, ranks: usize) -> Result<&Candidate, CostError> {
    let fits = |c: &&Candidate| cap.is_none_or(|cap| c.prediction.peak_bytes <= cap);
    if let Some(best) = candidates.iter().filter(fits).min_by(|a, b| a.prediction.ms.total_cmp(&b.prediction.ms)) {
        return Ok(best);
    }
    let smallest = candidates.iter().min_by_key(|c| c.prediction.peak_bytes);
    let (smallest, strategy) = smallest.map_or((0, "none".to_string()), |c| (c.prediction.peak_bytes, c.label.clone()));
    let cap = cap.unwrap_or(0);
    // A shard's peak shrinks about as 1 / ranks; tiles' does not.
    let shard_peak = candidates
        .iter()
        .filter(|c| matches!(c.strategy, Strategy::Shard(_) | Strategy::Shard2d(_)))
        .map(|c| c.prediction.peak_bytes)
        .min();
    let advice = match shard_peak {
        Some(peak) => {
            let more = (ranks.max(1) as f64 * peak as f64 / cap.max(1) as f64).ceil() as usize;
            format!("about {more} ranks might fit a shard, or smaller tiles (`tile_sample_min_size`) the tile mode")
        }
        None => "smaller tiles (`tile_sample_min_size`) might fit the tile mode".to_string(),
    };
    Err(CostError::NothingFits { cap, smallest, strategy, advice })
}

/// Reads a profile written by `vae-parallel calibrate`.
pub fn read_profile(path: &Path) -> Result<DeviceProfile, CostError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CostError::Profile { path: path.to_path_buf(), message: e.to_string() })?;
    let profile: DeviceProfile =
        toml::from_str(&text).map_err(|e| CostError::Profile { path: path.to_path_buf(), message: e.to_string() })?;
    profile.validate().map_err(|message| CostError::Profile { path: path.to_path_buf(), message })?;
    Ok(profile)
}

/// Where `calibrate` writes a device's profile by default:
/// `$XDG_CONFIG_HOME/vae-parallel/cpu-profile.toml` (or under `~/.config`), and
/// `cuda-profile.toml` beside it. The other commands look for the CPU one there.
pub fn default_profile_path(kind: DeviceKind) -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
    let name = match kind {
        DeviceKind::Cpu => "cpu-profile.toml",
        DeviceKind::Cuda => "cuda-profile.toml",
    };
    Some(base.join("vae-parallel").join(name))
}

/// The profile `calibrate` wrote at the default path, if a usable one is there (one that is
/// not is logged and passed over).
pub fn calibrated_profile() -> Option<DeviceProfile> {
    let path = default_profile_path(DeviceKind::Cpu).filter(|p| p.is_file())?;
    read_profile(&path).map_err(|e| tracing::warn!("{e}; passed over (run `vae-parallel calibrate` again)")).ok()
}

/// The profile at `path` (an error if it cannot be used), else the default path's when a
/// usable file is there (one that is not is logged and passed over), else this CPU's probed
/// constants ([`probe::probed_profile`]: the built-in ones scaled by a first-use probe, which
/// takes seconds once per CPU and is cached; the built-in ones as they are under
/// `VAE_COST_PROBE=0`).
pub fn load_profile(path: Option<&Path>) -> Result<DeviceProfile, CostError> {
    if let Some(path) = path {
        return read_profile(path);
    }
    Ok(calibrated_profile().unwrap_or_else(|| probe::probed_profile().clone()))
}

/// A loaded model's cost constants.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Constants {
    /// These (a profile file's, or the caller's).
    Given(Box<DeviceProfile>),
    /// This CPU's probed constants ([`probe::probed_profile`]), found when a request first
    /// needs them.
    ThisCpu,
}

/// The built-in constants, for a request that does not wait for the probe.
static BUILTIN: LazyLock<DeviceProfile> = LazyLock::new(DeviceProfile::builtin_cpu);

impl Constants {
    /// The constants: the given ones; or this CPU's, probed first where `probe` is set (a
    /// request whose choice depends on them) and otherwise what is known without measuring
    /// ([`probe::ready_profile`], else the built-in constants).
    pub(crate) fn get(&self, probe: bool) -> &DeviceProfile {
        match self {
            Self::Given(profile) => profile,
            Self::ThisCpu if probe => probe::probed_profile(),
            Self::ThisCpu => probe::ready_profile().unwrap_or(&BUILTIN),
        }
    }

    /// The kind of device the constants describe (without probing).
    pub(crate) fn kind(&self) -> DeviceKind {
        match self {
            Self::Given(profile) => profile.kind,
            Self::ThisCpu => DeviceKind::Cpu,
        }
    }
}

/// Parses a size: bytes, or a number with `K`, `M`, `G` or `T` (binary: KiB, MiB, ...; an
/// optional `iB` or `B`).
pub fn parse_size(text: &str) -> Result<u64, CostError> {
    let bad = |reason: &str| CostError::Size { text: text.to_string(), reason: reason.to_string() };
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().map_err(|_| bad("no number"))?;
    let shift = match unit.trim().to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(bad("the unit is not K, M, G or T")),
    };
    let bytes = value * (1u64 << shift) as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(bad("not a positive size"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vae_planner::ShardAxis;

    fn candidate(label: &str, strategy: Strategy, ms: f64, peak_bytes: u64) -> Candidate {
        Candidate {
            strategy,
            use_tiling: true,
            label: label.into(),
            prediction: Prediction { ms, peak_bytes, ranks: Vec::new() },
        }
    }

    #[test]
    fn auto_takes_the_fastest_strategy_that_fits_the_cap() {
        let all = [
            candidate("tile", Strategy::Tile, 900.0, 100 << 20),
            candidate("shard-height", Strategy::Shard(ShardAxis::Height), 500.0, 400 << 20),
            candidate("shard-2x2", Strategy::Shard2d([2, 2]), 600.0, 200 << 20),
        ];
        assert_eq!(choose(&all, None, 4).unwrap().label, "shard-height");
        assert_eq!(choose(&all, Some(300 << 20), 4).unwrap().label, "shard-2x2");
        assert_eq!(choose(&all, Some(100 << 20), 4).unwrap().label, "tile");
        let refused = choose(&all, Some(50 << 20), 4).unwrap_err().to_string();
        assert!(refused.contains("50.0 MiB") && refused.contains("100.0 MiB (tile)"), "{refused}");
        // The 2-D shard's 200 MiB over 4 ranks: about 16 ranks for 50 MiB.
        assert!(refused.contains("about 16 ranks"), "{refused}");
    }

    #[test]
    fn a_profile_survives_its_toml_file() {
        let profile = DeviceProfile::builtin_cpu();
        let text = toml::to_string_pretty(&profile).unwrap();
        let back: DeviceProfile = toml::from_str(&text).unwrap();
        assert_eq!(back, profile);
        let dir = std::env::temp_dir().join(format!("vae-cost-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.toml");
        std::fs::write(&path, "device = 3").unwrap();
        let err = read_profile(&path).unwrap_err().to_string();
        assert!(err.contains("p.toml"), "{err}");
        std::fs::write(&path, &text).unwrap();
        assert_eq!(load_profile(Some(&path)).unwrap(), profile);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sizes_parse_in_binary_units_and_refuse_nonsense() {
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("0").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("lots").is_err());
    }
}
