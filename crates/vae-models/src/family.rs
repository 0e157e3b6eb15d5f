//! The interface every VAE family implements, and the registry that finds a family by the
//! `_class_name` of a diffusers `config.json`.
//!
//! A family is one folder of this crate: its config, layers, model and operators, plus one
//! [`FamilySpec`] naming the diffusers classes it loads. [`FAMILIES`] lists the specs; nothing
//! outside a family's folder names its classes. The engine above holds a loaded model as a
//! `Box<dyn LoadedVae>` and serves every request through this trait, so adding a family adds a
//! folder and one line to [`FAMILIES`], and changes nothing in the runtime or the facade.

use std::any::Any;
use std::path::Path;

use vae_runtime::{
    DistributedVaeExecutor, ExecOutput, FrameSink, OutputPlacement, ParallelMode, Strategy, StrategyChoice,
};
use vae_tensor::{DType, Device, Tensor};

use crate::{ModelError, Result};

/// Encode or decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Latents to pixels.
    Decode,
    /// Pixels to latents.
    Encode,
}

/// The tile geometry a user may set, as the keywords of diffusers' `enable_tiling` and the
/// attributes it sets. Each family takes the keywords its class has and refuses the others
/// with a typed error; `None` keeps the model's current value.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TileOverrides {
    /// `tile_sample_min_size` (AutoencoderKL-style square tiles, pixels).
    pub sample_min_size: Option<usize>,
    /// `tile_overlap_factor` (AutoencoderKL-style).
    pub overlap_factor: Option<f64>,
    /// `tile_sample_min_height` (video VAEs, pixels).
    pub sample_min_height: Option<usize>,
    /// `tile_sample_min_width` (video VAEs, pixels).
    pub sample_min_width: Option<usize>,
    /// `tile_sample_stride_height` (video VAEs, pixels).
    pub sample_stride_height: Option<usize>,
    /// `tile_sample_stride_width` (video VAEs, pixels).
    pub sample_stride_width: Option<usize>,
    /// `tile_latent_min_height` (HunyuanVideo-1.5, latent pixels).
    pub latent_min_height: Option<usize>,
    /// `tile_latent_min_width` (HunyuanVideo-1.5, latent pixels).
    pub latent_min_width: Option<usize>,
    /// `tile_sample_min_num_frames` (LTX, frames); giving it tiles the frames.
    pub sample_min_num_frames: Option<usize>,
    /// `tile_sample_stride_num_frames` (LTX, frames); giving it tiles the frames.
    pub sample_stride_num_frames: Option<usize>,
}

impl TileOverrides {
    /// Whether a square-tile keyword (size or overlap) is set.
    pub fn has_square(&self) -> bool {
        self.sample_min_size.is_some() || self.overlap_factor.is_some()
    }

    /// Whether a pixel height / width / stride keyword is set.
    pub fn has_rectangular(&self) -> bool {
        self.sample_min_height.is_some()
            || self.sample_min_width.is_some()
            || self.sample_stride_height.is_some()
            || self.sample_stride_width.is_some()
    }

    /// Whether a pixel stride keyword is set.
    pub fn has_stride(&self) -> bool {
        self.sample_stride_height.is_some() || self.sample_stride_width.is_some()
    }

    /// Whether a latent tile keyword is set.
    pub fn has_latent(&self) -> bool {
        self.latent_min_height.is_some() || self.latent_min_width.is_some()
    }

    /// Whether a frame tile keyword is set.
    pub fn has_frames(&self) -> bool {
        self.sample_min_num_frames.is_some() || self.sample_stride_num_frames.is_some()
    }
}

/// One request for [`LoadedVae::execute`]: what to run, on which ranks, with the strategy the
/// family chose for it.
#[derive(Clone, Copy)]
pub struct Execution<'a> {
    /// The ranks.
    pub executor: &'a DistributedVaeExecutor,
    /// Decode or encode.
    pub direction: Direction,
    /// The latent (decode) or image / video (encode), as the VAE takes it (not normalised).
    pub input: &'a Tensor,
    /// What [`LoadedVae::strategy`] chose.
    pub strategy: Strategy,
    /// diffusers' `use_tiling` for this request (a parallel size above 1 forces it on).
    pub use_tiling: bool,
    /// Who receives the output.
    pub placement: OutputPlacement,
}

impl std::fmt::Debug for Execution<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("direction", &self.direction)
            .field("input", &self.input.dims())
            .field("strategy", &self.strategy)
            .field("use_tiling", &self.use_tiling)
            .field("placement", &self.placement)
            .finish()
    }
}

/// The cost model's view of one request ([`vae_planner::cost`]): the pass over the whole input,
/// and each tile's pass when the input is larger than one tile (empty otherwise).
#[derive(Debug, Clone)]
pub struct CostNetworks {
    /// The direct pass over the whole input (a shard runs it on parts of every map).
    pub whole: vae_planner::cost::Network,
    /// Each tile's pass, in the tile plan's order.
    pub tiles: Vec<vae_planner::cost::Network>,
    /// Whether the owner stitches tiles as they arrive (rather than gathering them all).
    pub stitched: bool,
}

impl CostNetworks {
    /// A request's passes as a family's 2-D tiling runs them: `pass` over the whole input
    /// (`extent`: its rows and columns) and over each tile of `layout` (None where the input
    /// fits one tile), the owner stitching tiles as they arrive. None where a pass is None.
    pub fn stitched(
        extent: [usize; 2],
        layout: Option<vae_planner::TileLayout2d>,
        pass: impl Fn([usize; 2]) -> Option<vae_planner::cost::Network>,
    ) -> Option<Self> {
        let tiles = match layout {
            Some(l) => l.tiles().map(|t| pass([t.input[0].len(), t.input[1].len()])).collect::<Option<_>>()?,
            None => Vec::new(),
        };
        Some(Self { whole: pass(extent)?, tiles, stitched: true })
    }
}

/// A loaded VAE of any family: what serving a request needs from it.
///
/// Policy methods ([`check_mode`](Self::check_mode), [`strategy`](Self::strategy)) must be
/// deterministic and depend only on global quantities, so that every rank decides alike.
pub trait LoadedVae: Send + Sync {
    /// The diffusers class that was loaded (`_class_name`).
    fn class_name(&self) -> &'static str;
    /// The models this class serves, for people (e.g. "Stable Diffusion, FLUX.1, Z-Image").
    fn models(&self) -> &'static str;
    /// Where the weights live and the model computes.
    fn device(&self) -> Device;
    /// The element type the model computes in.
    fn dtype(&self) -> DType;
    /// Refuses, with a typed error naming the class, a parallel mode this model cannot run.
    fn check_mode(&self, mode: ParallelMode) -> Result<()>;
    /// The strategy for one request of an input of `input_dims` over `ranks` ranks in `mode`
    /// (which [`check_mode`](Self::check_mode) accepted): tiles or a spatial shard, with the
    /// reason, flagged when a forced mode fell back.
    fn strategy(&self, direction: Direction, mode: ParallelMode, input_dims: &[usize], ranks: usize) -> StrategyChoice;
    /// The cost model's passes for a request on an `input_dims` input, or None where the
    /// family has no cost model (or the shape is not its input's): `auto` then follows the
    /// family's rules alone.
    fn cost_networks(&self, _direction: Direction, _input_dims: &[usize]) -> Option<CostNetworks> {
        None
    }
    /// Who receives the result when the request does not say: the reference system's contract
    /// for this class.
    fn default_placement(&self, direction: Direction) -> OutputPlacement;
    /// Latents as the family's diffusion pipeline produces them → latents the VAE decodes.
    fn denormalize_latents(&self, z: &Tensor) -> Result<Tensor>;
    /// The inverse, for an encoded mean.
    fn normalize_latents(&self, mean: &Tensor) -> Result<Tensor>;
    /// The keywords of this class's `enable_tiling` (the CLI's flags of the same names in kebab
    /// case), in diffusers' order.
    fn tiling_keywords(&self) -> &'static [&'static str];
    /// Sets the tile geometry as diffusers' `enable_tiling` would; refuses keywords this class
    /// does not have.
    fn enable_tiling(&mut self, tiling: &TileOverrides) -> Result<()>;
    /// Sets the timestep a timestep-conditioned decoder decodes at (the pipelines'
    /// `decode_timestep`); the default refuses: the decoder takes none.
    fn set_decode_timestep(&mut self, _timestep: f64) -> Result<()> {
        Err(ModelError::Unsupported(format!("{} has no timestep-conditioned decoder", self.class_name())))
    }
    /// Runs one request over the executor's ranks with the family's tile or shard operator.
    fn execute(&self, run: Execution<'_>) -> Result<ExecOutput>;
    /// The plain decode on this process (`vae.decode(z).sample` without tiling).
    fn decode(&self, z: &Tensor) -> Result<Tensor>;
    /// The untiled decode of a video latent `[B, C, T, H, W]` on this process, its output frames
    /// handed to `sink` as they are decoded ([`FrameSink`]), bit for bit those of the same
    /// request unstreamed: [`decode`](Self::decode)'s, except for a family whose frames are tiled
    /// apart from H and W (LTX's `use_framewise_decoding`), which tiles them here too. A causal video family streams them (its memory then does not
    /// grow with the frame count); this default decodes the whole video, then hands it on.
    fn decode_streaming(&self, z: &Tensor, sink: &mut dyn FrameSink) -> Result<()> {
        let out = self.decode(z)?;
        if out.dims().len() != 5 {
            return Err(ModelError::InvalidInput(format!(
                "a streaming decode takes a video latent [B, C, T, H, W], not {:?}",
                z.dims()
            )));
        }
        sink.begin(out.dims()).map_err(ModelError::Sink)?;
        sink.frames(0, out).map_err(ModelError::Sink)
    }
    /// Whether the family streams its video decode frame by frame
    /// ([`decode_streaming`](Self::decode_streaming) and
    /// [`execute_streaming`](Self::execute_streaming) over ranks); the default does not.
    fn streams(&self) -> bool {
        false
    }
    /// Runs one decode over the executor's ranks with its output frames streamed to `sink` (the
    /// owner's; `None` on the other ranks): the family's streamed sharded decode where it has
    /// one and `run.strategy` is a shard. The default refuses: no streamed strategy.
    fn execute_streaming(&self, run: Execution<'_>, _sink: Option<&mut dyn FrameSink>) -> Result<ExecOutput> {
        Err(ModelError::Unsupported(format!(
            "{} does not stream a {:?} decode over ranks",
            self.class_name(),
            run.strategy
        )))
    }
    /// For a process that serves one stage of pipelined decodes: lets go of every weight
    /// except those the stage of `rank` uses in a pipelined decode of `latent_dims` latents over
    /// `ranks` ranks, and returns the stage's steps (empty beyond the stages). The model then
    /// runs that stage of such decodes and refuses everything else. The default refuses: no
    /// pipeline.
    fn keep_only_pipeline_stage(
        &mut self,
        _latent_dims: &[usize],
        _ranks: usize,
        _rank: usize,
    ) -> Result<std::ops::Range<usize>> {
        Err(ModelError::Unsupported(format!("{} has no pipeline stages", self.class_name())))
    }
    /// The plain encode on this process: the raw moments (`vae._encode(x)` without tiling).
    fn encode_moments(&self, x: &Tensor) -> Result<Tensor>;
    /// What `inspect` shows beyond the class: labelled lines (parameters, channels, layout,
    /// tiling, latent statistics).
    fn describe(&self) -> Vec<(&'static str, String)>;
    /// The concrete model, for callers that need a family's own API.
    fn as_any(&self) -> &dyn Any;
}

/// A family's loader: a model directory whose `config.json` names one of the family's classes,
/// loaded onto a device, computing in an element type. The family reads its own config (the
/// class included: classes of one family may differ in defaults and policy).
pub type LoadFn = fn(dir: &Path, device: Device, dtype: DType) -> Result<Box<dyn LoadedVae>>;

/// One family as the registry knows it.
#[derive(Debug)]
pub struct FamilySpec {
    /// The diffusers classes (`_class_name`) this family loads.
    pub classes: &'static [&'static str],
    /// Loads one of them.
    pub load: LoadFn,
}

/// Every family, in the order `inspect` and errors list them. A `config.json` without
/// `_class_name` is read as the first class of the first family (diffusers' `AutoencoderKL`,
/// what the oldest Stable Diffusion checkpoints hold).
pub static FAMILIES: &[&FamilySpec] =
    &[&crate::autoencoder_kl::FAMILY, &crate::wan::FAMILY, &crate::hunyuan_video15::FAMILY, &crate::ltx::FAMILY];

/// Every class name the registry loads.
pub fn known_classes() -> impl Iterator<Item = &'static str> {
    FAMILIES.iter().flat_map(|f| f.classes.iter().copied())
}

/// The family that loads `class`.
pub fn family_of(class: &str) -> Option<&'static FamilySpec> {
    FAMILIES.iter().copied().find(|f| f.classes.contains(&class))
}

/// Reads `_class_name` from a model directory's `config.json` (the registry's default class
/// when the file has none).
pub fn class_name(dir: &Path) -> Result<String> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::Config { path: path.clone(), message: e.to_string() })?;
    match value.get("_class_name") {
        None => Ok(FAMILIES[0].classes[0].to_string()),
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(ModelError::Config { path, message: format!("_class_name must be a string, got {other}") }),
    }
}

/// Loads a diffusers VAE directory with the family its `_class_name` names, onto `device`,
/// computing in `dtype`.
pub fn load(dir: &Path, device: Device, dtype: DType) -> Result<Box<dyn LoadedVae>> {
    let class = class_name(dir)?;
    let family = family_of(&class).ok_or_else(|| ModelError::Config {
        path: dir.join("config.json"),
        message: format!(
            "{class:?} is not a VAE class vae-parallel knows (it loads {})",
            known_classes().collect::<Vec<_>>().join(", ")
        ),
    })?;
    (family.load)(dir, device, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_class_belongs_to_exactly_one_family() {
        let all: Vec<&str> = known_classes().collect();
        for class in &all {
            assert_eq!(all.iter().filter(|c| *c == class).count(), 1, "{class}");
            assert!(family_of(class).is_some());
        }
        assert!(family_of("UNet2DModel").is_none());
    }

    #[test]
    fn the_class_name_is_read_from_the_config() {
        let dir = std::env::temp_dir().join(format!("vae-models-class-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("config.json");
        std::fs::write(&config, r#"{"_class_name": "AutoencoderKLWan"}"#).unwrap();
        assert_eq!(class_name(&dir).unwrap(), "AutoencoderKLWan");
        std::fs::write(&config, r#"{"latent_channels": 4}"#).unwrap();
        assert_eq!(class_name(&dir).unwrap(), FAMILIES[0].classes[0]);
        std::fs::write(&config, r#"{"_class_name": 3}"#).unwrap();
        assert!(matches!(class_name(&dir), Err(ModelError::Config { .. })));
        std::fs::write(&config, r#"{"_class_name": "UNet2DModel"}"#).unwrap();
        let err = load(&dir, Device::Cpu, DType::F32).err().expect("an unknown class");
        assert!(err.to_string().contains("\"UNet2DModel\" is not a VAE class"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
