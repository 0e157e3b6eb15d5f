//! `vae-parallel demo`: the README's main job with nothing to download. A small AutoencoderKL
//! trained on public-domain photos (`fixtures/demo_vae`, built into the binary) encodes a photo
//! it never saw, then decodes the latent on one rank and on N ranks in the tile mode, in height
//! bands and in a 2-D grid of blocks; every N-rank decode is compared bit for bit with its
//! one-rank counterpart (the tiles with the tiled decode, the shards with the untiled one), and
//! the pictures are written side by side. `--operator synthetic` runs the executor alone on a
//! stand-in decoder instead ([`crate::cli::demo_synthetic`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};

use crate::cli::ranks::GroupArgs;
use crate::models::autoencoder_kl::AutoencoderKl;
use crate::report::{RequestReport, human_bytes};
use crate::runtime::ParallelMode;
use crate::{Decode, Device, Encode, Finished, Group, Request, Tensor, Vae, io};

/// The demo model and photo, built into the binary: the demo needs no checkout and no download.
const DEMO_CONFIG: &[u8] = include_bytes!("../../../../fixtures/demo_vae/config.json");
const DEMO_WEIGHTS: &[u8] = include_bytes!("../../../../fixtures/demo_vae/diffusion_pytorch_model.safetensors");
const DEMO_PHOTO: &[u8] = include_bytes!("../../../../fixtures/demo_vae/chelsea_256.png");

/// Which operator the demo runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DemoOperator {
    /// The built-in trained AutoencoderKL on a photo.
    Vae,
    /// A stand-in decoder: nearest upsampling, doubled, offset per tile.
    Synthetic,
}

/// Options of `vae-parallel demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    #[command(flatten)]
    pub(crate) group: GroupArgs,
    /// What to run.
    #[arg(long, value_enum, default_value_t = DemoOperator::Vae)]
    pub(crate) operator: DemoOperator,
    /// A diffusers AutoencoderKL directory to run instead of the built-in one.
    #[arg(long)]
    model: Option<PathBuf>,
    /// An 8-bit PNG to encode instead of the built-in photo (its size a multiple of the
    /// model's scale).
    #[arg(long)]
    image: Option<PathBuf>,
    /// Ranks that execute tiles (default: all).
    #[arg(long)]
    pub(crate) parallel_size: Option<usize>,
    /// The VAE: crop the photo to this many pixel rows (from the top left). Synthetic operator:
    /// latent height (default 60).
    #[arg(long)]
    pub(crate) height: Option<usize>,
    /// The VAE: crop the photo to this many pixel columns. Synthetic operator: latent width
    /// (default 104).
    #[arg(long)]
    pub(crate) width: Option<usize>,
    /// Synthetic operator: input channels.
    #[arg(long, default_value_t = 4)]
    pub(crate) channels: usize,
    /// Synthetic operator: tile size in latent units.
    #[arg(long, default_value_t = 32)]
    pub(crate) tile: usize,
    /// Synthetic operator: tile stride in latent units.
    #[arg(long, default_value_t = 24)]
    pub(crate) stride: usize,
    /// Synthetic operator: output pixels per latent unit.
    #[arg(long, default_value_t = 8)]
    pub(crate) scale: usize,
    /// Synthetic operator: simulated work per tile, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub(crate) work_ms: u64,
    /// Synthetic operator: give the output to every rank instead of rank 0 only.
    #[arg(long)]
    pub(crate) broadcast: bool,
    /// Where the VAE demo writes its pictures side by side (PNG): the photo, one rank, then the
    /// N-rank tile, band and block decodes.
    #[arg(long, default_value = "vae-parallel-demo.png")]
    out: PathBuf,
    /// Also write the reports as JSON to this file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Also write a figure to this file (SVG): the VAE demo's tiles, bands and blocks over the
    /// picture and a timeline of every rank; the synthetic one's rank timeline.
    #[arg(long)]
    pub(crate) svg: Option<PathBuf>,
}

/// One decode of the demo and what it is compared with.
struct Run {
    /// How it is named in the table.
    label: &'static str,
    /// What ran, the report's way (`tile (9)`, `shard-height`).
    strategy: String,
    seconds: f64,
    /// The busiest rank's peak above what it held when the request started.
    peak_bytes: u64,
    /// The pixels (on rank 0).
    pixels: Tensor,
    /// Which one-rank decode gives the same pixels.
    reference: Reference,
    report: Option<RequestReport>,
}

/// The one-rank decodes the N-rank ones are compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reference {
    /// `vae.decode(z)`.
    Untiled,
    /// `vae.enable_tiling(); vae.decode(z)`.
    Tiled,
}

impl Reference {
    fn name(self) -> &'static str {
        match self {
            Self::Untiled => "untiled, 1 rank",
            Self::Tiled => "tiled, 1 rank",
        }
    }
}

/// Runs the demo and prints what happened.
pub fn run(args: &DemoArgs) -> anyhow::Result<ExitCode> {
    for path in std::iter::once(&args.out).chain(&args.json).chain(&args.svg) {
        if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty())
            && !dir.is_dir()
        {
            anyhow::bail!("output directory {} does not exist", dir.display());
        }
    }
    if args.operator == DemoOperator::Synthetic {
        return crate::cli::demo_synthetic::run(args);
    }
    let group = match crate::cli::ranks::ranks(&args.group, None)?.group()? {
        Ok(group) => group,
        Err(supervised) => return Ok(supervised),
    };
    // The built-in model goes to a private directory of this process for the loader.
    let unpacked = tempfile::Builder::new().prefix("vae-parallel-demo-").tempdir()?;
    let model_dir = match &args.model {
        Some(dir) => dir.clone(),
        None => {
            std::fs::write(unpacked.path().join("config.json"), DEMO_CONFIG)?;
            std::fs::write(unpacked.path().join("diffusion_pytorch_model.safetensors"), DEMO_WEIGHTS)?;
            unpacked.path().to_path_buf()
        }
    };
    let vae = Vae::load(&model_dir)?;
    let photo = match &args.image {
        Some(path) => io::read_png(path)?,
        None => io::png_from_bytes(DEMO_PHOTO)?,
    };
    let photo = crop(photo, args.height, args.width)?;

    let n = group.size();
    let started = Instant::now();
    // Height bands: the exact untiled encode over the ranks (a named mode, so that the demo's
    // first run on a new machine spends no time probing it for the cost model).
    let encode = Encode::default().mode(ParallelMode::SpatialShardHeight);
    let encoded = group.run(&vae, Request::encode(&photo, &encode))?;
    let encode_seconds = started.elapsed().as_secs_f64();
    let encode_report = encoded.report;
    let latent = encoded.output.context("every rank receives the latent")?;
    let decodes = [
        ("tile", Decode::default().mode(ParallelMode::Tile).tiled(), Reference::Tiled),
        ("spatial_shard_height", Decode::default().mode(ParallelMode::SpatialShardHeight), Reference::Untiled),
        ("spatial_shard_2d", Decode::default().mode(ParallelMode::SpatialShard2d), Reference::Untiled),
    ];
    let mut runs = Vec::new();
    for (label, options, reference) in decodes {
        let options = match args.parallel_size {
            Some(p) => options.parallel_size(p),
            None => options,
        };
        let started = Instant::now();
        let finished = group.run(&vae, Request::decode(&latent, &options))?;
        runs.push((label, reference, started.elapsed().as_secs_f64(), finished));
    }
    if group.rank() != 0 {
        return Ok(ExitCode::SUCCESS);
    }

    // The one-rank decodes, on this process.
    let one = Group::local(1)?;
    let mut references = Vec::new();
    for (reference, options) in [(Reference::Untiled, Decode::default()), (Reference::Tiled, Decode::default().tiled())]
    {
        let started = Instant::now();
        let finished = one.run(&vae, Request::decode(&latent, &options))?;
        references.push(run_of(reference.name(), reference, started.elapsed().as_secs_f64(), finished)?);
    }
    let runs: Vec<Run> = runs
        .into_iter()
        .map(|(label, reference, seconds, finished)| run_of(label, reference, seconds, finished))
        .collect::<anyhow::Result<_>>()?;
    let reference = |r: Reference| &references[if r == Reference::Untiled { 0 } else { 1 }].pixels;

    println!(
        "vae-parallel demo: {} ({}, {} parameters) on a {}x{} photo, {n} rank(s) ({} transport)",
        if args.model.is_some() { model_dir.display().to_string() } else { "the built-in trained VAE".into() },
        vae.class_name(),
        vae.model().describe().iter().find(|(k, _)| *k == "parameters").map_or("?".into(), |(_, v)| v.clone()),
        photo.dims()[3],
        photo.dims()[2],
        group.backend()
    );
    println!(
        "  encode {:?} -> latent {:?} on {n} rank(s): {} in {:.0} ms",
        photo.dims(),
        latent.dims(),
        encode_report.as_ref().map_or("-".into(), RequestReport::what_ran),
        encode_seconds * 1e3
    );
    println!();
    println!("  {:<22} {:>5}  {:<14} {:>9} {:>12}  same pixels as", "decode", "ranks", "ran as", "ms", "peak/rank");
    let mut identical = true;
    for (run, compared) in references.iter().map(|r| (r, false)).chain(runs.iter().map(|r| (r, true))) {
        let same = if compared {
            let ok = run.pixels.bit_eq(reference(run.reference));
            identical &= ok;
            if ok {
                format!("{}: bit-identical", run.reference.name())
            } else {
                format!("{}: MISMATCH", run.reference.name())
            }
        } else {
            "-".to_string()
        };
        println!(
            "  {:<22} {:>5}  {:<14} {:>9.1} {:>12}  {same}",
            run.label,
            run.report.as_ref().map_or(1, |r| r.world_size),
            run.strategy,
            run.seconds * 1e3,
            human_bytes(run.peak_bytes)
        );
    }
    let untiled = reference(Reference::Untiled);
    let panels = [&photo, untiled, &runs[0].pixels, &runs[1].pixels, &runs[2].pixels];
    let written = io::write_decoded(&args.out, &side_by_side(&panels)?, 16)?;
    println!();
    println!(
        "  wrote {}: the photo | 1 rank | {n} ranks: tiles | height bands | 2-D blocks",
        written.first().map_or_else(|| args.out.display().to_string(), |p| p.display().to_string())
    );
    let reports: Vec<&RequestReport> = runs.iter().filter_map(|r| r.report.as_ref()).collect();
    if let Some(path) = &args.json {
        io::write_atomically(path, &serde_json::to_vec_pretty(&reports)?)?;
        println!("  reports written to {}", path.display());
    }
    if let Some(path) = &args.svg {
        let layout = tile_layout(&vae, &latent);
        let figure = crate::cli::figure::figure(untiled, layout.as_ref(), &reports)?;
        io::write_atomically(path, figure.as_bytes())?;
        println!("  figure written to {}", path.display());
    }
    if identical {
        println!("  result: every {n}-rank decode is bit-identical to its one-rank decode");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("  result: MISMATCH between a {n}-rank decode and its one-rank decode");
        Ok(ExitCode::FAILURE)
    }
}

/// A request's row of the table.
fn run_of(label: &'static str, reference: Reference, seconds: f64, finished: Finished) -> anyhow::Result<Run> {
    let pixels = finished.output.context("rank 0 holds the pixels")?;
    let report = finished.report;
    let strategy = match &report {
        // One tile is the whole latent: the direct decode.
        Some(r) if r.strategy == "tile" && r.tile_count <= 1 => "direct".to_string(),
        Some(r) => r.what_ran(),
        None => "direct".to_string(),
    };
    let peak_bytes = report
        .as_ref()
        .and_then(|r| r.ranks.iter().map(|s| s.peak_bytes.saturating_sub(s.start_bytes)).max())
        .unwrap_or(finished.peak_bytes);
    Ok(Run { label, strategy, seconds, peak_bytes, pixels, reference, report })
}

/// The photo's top-left `height` × `width` pixels (all of it where not given).
fn crop(photo: Tensor, height: Option<usize>, width: Option<usize>) -> anyhow::Result<Tensor> {
    let (h, w) = (photo.dims()[2], photo.dims()[3]);
    let (ch, cw) = (height.unwrap_or(h), width.unwrap_or(w));
    anyhow::ensure!(ch >= 1 && cw >= 1 && ch <= h && cw <= w, "--height/--width: the photo is {w}x{h} pixels");
    if (ch, cw) == (h, w) {
        return Ok(photo);
    }
    Ok(photo.narrow(2, 0, ch)?.narrow(3, 0, cw)?)
}

/// Images `[1, 3, H, W]` of one height side by side, a white gap between them.
fn side_by_side(images: &[&Tensor]) -> anyhow::Result<Tensor> {
    let h = images[0].dims()[2];
    let gap = Tensor::from_vec(vec![1.0; 3 * h * 4], vec![1, 3, h, 4], &Device::Cpu)?;
    let mut parts: Vec<&Tensor> = Vec::new();
    for (i, image) in images.iter().enumerate() {
        if i > 0 {
            parts.push(&gap);
        }
        parts.push(image);
    }
    Ok(Tensor::cat(&parts, 3)?)
}

/// The tiles of a tiled decode of `latent` (an AutoencoderKL's; None for another family).
fn tile_layout(vae: &Vae, latent: &Tensor) -> Option<crate::planner::TileLayout2d> {
    let kl: &AutoencoderKl = vae.model().as_any().downcast_ref()?;
    let d = latent.dims();
    kl.tiling().decode_layout(d[2], d[3], kl.config().spatial_scale()).ok()
}
