//! [`Settings`]: a request's and a group's settings by name, as text or numbers (the CLI's flags,
//! a `--config` TOML file, the Python keywords, a service's JSON options), and their one
//! resolution into typed values ([`Settings::resolve`]), so that every front end refuses the
//! same values with the same words.
//!
//! The names are the reference system's (`vae_patch_parallel_size`, `vae_parallel_mode`, ...):
//! the TOML keys, the CLI's flags in kebab case. Errors name an option in backticks
//! (`` `shard_grid` ``); [`rename_options`] rewrites those names into a front end's own
//! spelling (the CLI's `--shard-grid`, Python's `mode` for `vae_parallel_mode`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vae_models::TileOverrides;
use vae_runtime::{OutputPlacement, ParallelMode, TileMerge};
use vae_tensor::{DType, Device};

use crate::error::{Error, Result};
use crate::launch::TransportKind;
use crate::options::{Options, Tiling};
use crate::vae::{CostProfile, VaeBuilder};

/// Every setting by name; `None` where not given. Flags over a file over defaults:
/// [`Settings::or`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)] // each field is the option of the same name, documented in the CLI's help
pub struct Settings {
    pub vae_patch_parallel_size: Option<usize>,
    pub vae_parallel_mode: Option<String>,
    pub shard_grid: Option<String>,
    pub tile_merge: Option<String>,
    pub vae_use_tiling: Option<bool>,
    pub tile_sample_min_size: Option<usize>,
    pub tile_overlap_factor: Option<f64>,
    pub tile_sample_min_height: Option<usize>,
    pub tile_sample_min_width: Option<usize>,
    pub tile_sample_stride_height: Option<usize>,
    pub tile_sample_stride_width: Option<usize>,
    pub tile_latent_min_height: Option<usize>,
    pub tile_latent_min_width: Option<usize>,
    pub tile_sample_min_num_frames: Option<usize>,
    pub tile_sample_stride_num_frames: Option<usize>,
    pub decode_timestep: Option<f64>,
    pub latents_normalized: Option<bool>,
    pub placement: Option<String>,
    pub ranks: Option<usize>,
    pub transport: Option<String>,
    pub threads: Option<usize>,
    pub device: Option<String>,
    pub dtype: Option<String>,
    pub max_memory_per_rank: Option<String>,
    pub profile: Option<PathBuf>,
}

/// The names errors use for options beyond [`Settings`]' fields: what an encode returns, a
/// video's frame rate.
pub const OTHER_OPTIONS: &[&str] = &["output", "fps"];

/// Settings resolved into typed values: what to load, where the ranks run, and the options of
/// every request.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The device asked for.
    pub requested_device: Device,
    /// Where the model computes: the device asked for, or the CPU where it cannot be used.
    pub device: Device,
    /// Why the device asked for cannot be used, if it cannot (the CPU runs instead).
    pub device_fallback: Option<String>,
    /// The element type the model computes in.
    pub dtype: DType,
    /// f32 convolutions with one TF32 product each (`dtype` tf32).
    pub tf32: bool,
    /// Ranks of the group (default: the parallel size).
    pub ranks: usize,
    /// Ranks that compute (`vae_patch_parallel_size`, default 1).
    pub parallel_size: usize,
    /// How the ranks are linked.
    pub transport: TransportKind,
    /// Compute threads of this process, if set.
    pub threads: Option<usize>,
    /// The tile geometry given.
    pub tiling: TileOverrides,
    /// The timestep of a timestep-conditioned decoder, if set.
    pub decode_timestep: Option<f64>,
    /// The profile file, if named.
    pub profile: Option<PathBuf>,
    /// The options of every request (the reference's tiling semantics: [`Tiling::Reference`]).
    pub options: Options,
}

impl Settings {
    /// Reads a TOML file of settings (the same names, with underscores).
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| crate::io::IoError::Os { path: path.to_path_buf(), source })?;
        toml::from_str(&text).map_err(|e| {
            crate::io::IoError::Format { path: path.to_path_buf(), message: format!("not a settings file: {e}") }.into()
        })
    }

    /// These settings, each one not given taken from `fallback`.
    pub fn or(self, fallback: Settings) -> Settings {
        macro_rules! pick {
            ($($field:ident),*) => { Settings { $($field: self.$field.or(fallback.$field)),* } };
        }
        pick!(
            vae_patch_parallel_size,
            vae_parallel_mode,
            shard_grid,
            tile_merge,
            vae_use_tiling,
            tile_sample_min_size,
            tile_overlap_factor,
            tile_sample_min_height,
            tile_sample_min_width,
            tile_sample_stride_height,
            tile_sample_stride_width,
            tile_latent_min_height,
            tile_latent_min_width,
            tile_sample_min_num_frames,
            tile_sample_stride_num_frames,
            decode_timestep,
            latents_normalized,
            placement,
            ranks,
            transport,
            threads,
            device,
            dtype,
            max_memory_per_rank,
            profile
        )
    }

    /// The tile geometry these settings give.
    pub fn tile_overrides(&self) -> TileOverrides {
        TileOverrides {
            sample_min_size: self.tile_sample_min_size,
            overlap_factor: self.tile_overlap_factor,
            sample_min_height: self.tile_sample_min_height,
            sample_min_width: self.tile_sample_min_width,
            sample_stride_height: self.tile_sample_stride_height,
            sample_stride_width: self.tile_sample_stride_width,
            latent_min_height: self.tile_latent_min_height,
            latent_min_width: self.tile_latent_min_width,
            sample_min_num_frames: self.tile_sample_min_num_frames,
            sample_stride_num_frames: self.tile_sample_stride_num_frames,
        }
    }

    /// Every setting parsed and checked, defaults filled in. A CUDA device that cannot be used
    /// resolves to the CPU, with the reason in [`Resolved::device_fallback`] for the caller to
    /// say; the element type is checked against the device that resolves.
    pub fn resolve(&self) -> Result<Resolved> {
        let parallel_size = self.vae_patch_parallel_size.unwrap_or(1);
        if parallel_size == 0 {
            return Err(Error::invalid_option("`vae_patch_parallel_size` must be at least 1"));
        }
        let mode = parse_mode(self.vae_parallel_mode.as_deref().unwrap_or("tile"))?;
        let shard_grid = self.shard_grid.as_deref().map(parse_grid).transpose()?;
        let tile_merge: TileMerge = match self.tile_merge.as_deref() {
            None => TileMerge::default(),
            Some(text) => text
                .parse()
                .map_err(|_| Error::invalid_option(format!("`tile_merge` must be owner or edges, not {text:?}")))?,
        };
        let placement = self.placement.as_deref().map(parse_placement).transpose()?;
        if self.threads == Some(0) {
            return Err(Error::invalid_option("`threads` must be at least 1"));
        }
        let transport: TransportKind = self.transport.as_deref().unwrap_or("local").parse()?;
        let requested = parse_device(self.device.as_deref().unwrap_or("cpu"))?;
        // Why the device cannot be used goes back to the caller, which says it its own way.
        let (device, device_fallback) = vae_tensor::cuda::resolve_device(requested);
        let (dtype, tf32) = parse_dtype(self.dtype.as_deref().unwrap_or("f32"), device)?;
        let ranks = self.ranks.unwrap_or(parallel_size);
        if ranks == 0 {
            return Err(Error::invalid_option("`ranks` must be at least 1"));
        }
        let max_memory_per_rank = self.max_memory_per_rank.as_deref().map(parse_memory).transpose()?;
        if transport == TransportKind::Nccl {
            if requested != Device::Cuda(0) {
                return Err(Error::invalid_option(format!(
                    "`transport` nccl runs rank r on cuda:r: pass `device` cuda, not {requested}"
                )));
            }
            if device.is_cpu() {
                return Err(Error::invalid_option(
                    "`transport` nccl needs usable GPUs, and cuda:0 is not (see the warning above)",
                ));
            }
        }
        let options = Options {
            mode,
            tiling: Tiling::Reference { asked: self.vae_use_tiling.unwrap_or(false) },
            latents_normalized: self.latents_normalized.unwrap_or(false),
            placement,
            max_memory_per_rank,
            shard_grid,
            parallel_size: Some(parallel_size),
            tile_merge,
            ..Options::default()
        };
        options.validate()?;
        Ok(Resolved {
            requested_device: requested,
            device,
            device_fallback,
            dtype,
            tf32,
            ranks,
            parallel_size,
            transport,
            threads: self.threads,
            tiling: self.tile_overrides(),
            decode_timestep: self.decode_timestep,
            profile: self.profile.clone(),
            options,
        })
    }
}

impl Resolved {
    /// The builder of the model at `dir` on `device` (this rank's: an NCCL rank's own GPU),
    /// with these settings' precision, tiles, timestep and profile.
    pub fn vae_builder(&self, dir: &Path, device: Device) -> VaeBuilder {
        let mut builder = crate::Vae::builder(dir)
            .device(device)
            .dtype(self.dtype)
            .tf32(self.tf32)
            .tiling(self.tiling)
            .cost_profile(self.profile.clone().map_or(CostProfile::Default, CostProfile::File));
        if let Some(t) = self.decode_timestep {
            builder = builder.decode_timestep(t);
        }
        builder
    }
}

/// A parallel mode by name.
pub fn parse_mode(text: &str) -> Result<ParallelMode> {
    text.trim()
        .parse()
        .map_err(|e: vae_runtime::UnknownMode| Error::invalid_option(format!("`vae_parallel_mode`: {e}")))
}

/// A 2-D shard's grid, `RxC`.
pub fn parse_grid(text: &str) -> Result<[usize; 2]> {
    vae_planner::parse_grid(text).map_err(|e| Error::invalid_option(format!("`shard_grid`: {e}")))
}

/// Who receives an output: `owner` or `all`.
pub fn parse_placement(text: &str) -> Result<OutputPlacement> {
    match text.trim() {
        "owner" => Ok(OutputPlacement::OwnerOnly),
        "all" => Ok(OutputPlacement::AllRanks),
        other => Err(Error::invalid_option(format!("`placement` must be owner or all, not {other:?}"))),
    }
}

/// A device: `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(text: &str) -> Result<Device> {
    text.parse().map_err(|_| Error::invalid_option(format!("`device` {text:?} is not cpu, cuda or cuda:N")))
}

/// A memory size: bytes, or a number with `K`, `M`, `G` or `T` (binary units).
pub fn parse_memory(text: &str) -> Result<u64> {
    crate::cost::parse_size(text).map_err(|e| Error::invalid_option(format!("`max_memory_per_rank`: {e}")))
}

/// What `dtype` asks for on `device` (after the CUDA probe): the element type, and whether f32
/// convolutions take one TF32 product each (`tf32`). A type the device cannot compute in is
/// refused, never run quietly in f32: the numbers would not be the ones asked for.
pub fn parse_dtype(text: &str, device: Device) -> Result<(DType, bool)> {
    let (dtype, tf32) = match text.trim() {
        "f32" => (DType::F32, false),
        "bf16" => (DType::BF16, false),
        "tf32" => (DType::F32, true),
        other => return Err(Error::invalid_option(format!("`dtype` {other:?} is not f32, bf16 or tf32"))),
    };
    if device.is_cpu() && dtype == DType::BF16 {
        // bf16 convolutions on the CPU, where it has AVX512-BF16; refused naming what it lacks.
        if let Err(err) = vae_tensor::CpuBf16Scope::enter() {
            return Err(Error::Model(vae_models::ModelError::Unsupported(format!(
                "`dtype` bf16 on the CPU: {err}; use `dtype` f32 (or `device` cuda)"
            ))));
        }
        return Ok((dtype, tf32));
    }
    if !device.computes_in(dtype) || (tf32 && device.is_cpu()) {
        let asked = if tf32 { "tf32".to_string() } else { dtype.to_string() };
        return Err(Error::Model(vae_models::ModelError::Unsupported(format!(
            "`dtype` {asked} needs a CUDA device (the CPU computes in f32 or bf16); use `device` cuda or `dtype` f32"
        ))));
    }
    Ok((dtype, tf32))
}

/// `text` with every option named in backticks (`` `shard_grid` ``) that `spell` knows written
/// as it says; the others keep their backticks.
///
/// ```
/// use vae_parallel::settings::{rename_options, cli_flag};
///
/// let line = "`shard_grid` applies to `vae_parallel_mode` spatial_shard_2d, not tile";
/// assert_eq!(rename_options(line, cli_flag), "--shard-grid applies to --vae-parallel-mode spatial_shard_2d, not tile");
/// ```
pub fn rename_options(text: &str, spell: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find('`') {
        let after = &rest[start + 1..];
        let Some(len) = after.find('`') else { break };
        let name = &after[..len];
        let is_name =
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_' || b.is_ascii_digit());
        match spell(name).filter(|_| is_name) {
            Some(spelled) => {
                out.push_str(&rest[..start]);
                out.push_str(&spelled);
                rest = &after[len + 1..];
            }
            None => {
                out.push_str(&rest[..start + 1 + len + 1]);
                rest = &after[len + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The CLI's flag for an option the settings name (`shard_grid` → `--shard-grid`).
pub fn cli_flag(name: &str) -> Option<String> {
    let known = SETTINGS_NAMES.contains(&name) || OTHER_OPTIONS.contains(&name);
    known.then(|| format!("--{}", name.replace('_', "-")))
}

/// The names of [`Settings`]' fields, in declaration order (a test checks them against the
/// struct).
pub const SETTINGS_NAMES: &[&str] = &[
    "vae_patch_parallel_size",
    "vae_parallel_mode",
    "shard_grid",
    "tile_merge",
    "vae_use_tiling",
    "tile_sample_min_size",
    "tile_overlap_factor",
    "tile_sample_min_height",
    "tile_sample_min_width",
    "tile_sample_stride_height",
    "tile_sample_stride_width",
    "tile_latent_min_height",
    "tile_latent_min_width",
    "tile_sample_min_num_frames",
    "tile_sample_stride_num_frames",
    "decode_timestep",
    "latents_normalized",
    "placement",
    "ranks",
    "transport",
    "threads",
    "device",
    "dtype",
    "max_memory_per_rank",
    "profile",
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn every_field_has_its_name_listed() {
        let serde_json::Value::Object(map) = serde_json::to_value(Settings::default()).unwrap() else { panic!() };
        let fields: Vec<&str> = map.keys().map(String::as_str).collect();
        let mut listed = SETTINGS_NAMES.to_vec();
        listed.sort_unstable();
        let mut fields = fields.clone();
        fields.sort_unstable();
        assert_eq!(fields, listed);
    }

    #[test]
    fn flags_win_over_the_file_and_defaults_fill_the_rest() {
        let file = Settings { vae_parallel_mode: Some("auto".into()), ranks: Some(3), ..Settings::default() };
        let flags = Settings { ranks: Some(2), vae_patch_parallel_size: Some(2), ..Settings::default() };
        let resolved = flags.or(file).resolve().unwrap();
        assert_eq!((resolved.ranks, resolved.parallel_size), (2, 2));
        assert_eq!(resolved.options.mode, ParallelMode::Auto);
        assert_eq!(resolved.options.tiling, Tiling::Reference { asked: false });
        assert_eq!(resolved.transport, TransportKind::Local);
        assert_eq!(resolved.device, Device::Cpu);
    }

    #[test]
    fn bad_values_are_refused_naming_the_option() {
        let refuse = |s: Settings| s.resolve().unwrap_err();
        let err = refuse(Settings { vae_patch_parallel_size: Some(0), ..Settings::default() });
        assert_eq!(err.kind(), ErrorKind::InvalidOption);
        assert_eq!(rename_options(&err.to_string(), cli_flag), "--vae-patch-parallel-size must be at least 1");
        let err = refuse(Settings { shard_grid: Some("2x2".into()), ..Settings::default() });
        assert_eq!(
            rename_options(&err.to_string(), cli_flag),
            "--shard-grid applies to --vae-parallel-mode spatial_shard_2d, not tile"
        );
        for bad in [
            Settings { vae_parallel_mode: Some("sideways".into()), ..Settings::default() },
            Settings { placement: Some("rank3".into()), ..Settings::default() },
            Settings { transport: Some("carrier-pigeon".into()), ..Settings::default() },
            Settings { max_memory_per_rank: Some("lots".into()), ..Settings::default() },
            Settings { dtype: Some("f64".into()), ..Settings::default() },
            Settings { device: Some("tpu".into()), ..Settings::default() },
            Settings { tile_merge: Some("sideways".into()), ..Settings::default() },
        ] {
            assert_eq!(refuse(bad).kind(), ErrorKind::InvalidOption);
        }
        let tf32 = refuse(Settings { dtype: Some("tf32".into()), ..Settings::default() });
        assert_eq!(tf32.kind(), ErrorKind::Unsupported);
    }

    #[test]
    fn only_known_names_are_renamed() {
        let line = "`max_memory_per_rank` needs `a profile` and `mystery_option`; `fps`";
        assert_eq!(
            rename_options(line, cli_flag),
            "--max-memory-per-rank needs `a profile` and `mystery_option`; --fps"
        );
        assert_eq!(rename_options("a ` lone backtick", cli_flag), "a ` lone backtick");
    }
}
