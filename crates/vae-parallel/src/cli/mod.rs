//! The `vae-parallel` command line ([`main`]): argument parsing, progress bars, tables and the
//! log subscriber over the library's API, and `vae-parallel serve`. It lives in the library,
//! under the `cli` feature, so that any package can build the command: `src/main.rs` here, and
//! the Python package's crate, whose wheel ships it beside the extension built with the same
//! dependencies' features (one build of the tree for both).

#![allow(clippy::print_stdout, clippy::print_stderr)] // the CLI owns the terminal

mod bench;
mod calibrate;
mod demo;
mod demo_synthetic;
mod figure;
mod kernel_bench;
mod model_cmds;
mod plan_cmd;
mod progress_bar;
mod ranks;
mod serve;
mod serve_bench;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

/// Spread the VAE encode/decode of diffusion models over ranks (threads, processes or GPUs) and
/// get the same pixels one device would.
#[derive(Debug, Parser)]
#[command(name = "vae-parallel", version, about)]
struct Cli {
    /// More log output (-v: info, -vv: debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A photo through a small trained VAE built into the binary (no downloads): encoded, then
    /// decoded on one rank and on N ranks in tiles, bands and 2-D blocks, every N-rank decode
    /// checked bit for bit against one rank's, the pictures written side by side.
    Demo(demo::DemoArgs),
    /// Decode a latent with a diffusers VAE.
    Decode(model_cmds::DecodeArgs),
    /// Encode an image with a diffusers VAE.
    Encode(model_cmds::EncodeArgs),
    /// Describe a diffusers VAE directory.
    Inspect(model_cmds::InspectArgs),
    /// The cost model's table for one request: every strategy with its predicted latency and
    /// peak memory per rank, and what `auto` would run (`--measure` also runs each).
    Plan(plan_cmd::PlanArgs),
    /// Measure this machine's constants for the cost model (convolution, element-wise,
    /// attention and link rates) and write them as a TOML profile; `--device cuda` measures a
    /// GPU in `--dtype` (an error without a usable one).
    Calibrate(calibrate::CalibrateArgs),
    /// Serve decodes and encodes over HTTP: the group and every model's weights stay loaded
    /// between requests (docs/serving.md).
    Serve(serve::ServeArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// The devices this machine and build can use: CUDA devices the driver reports, the CUDA
    /// kernels embedded in this build, and where `--device cuda` work would run.
    Devices,
}

/// A `--shape` flag's sizes, comma-separated (`1,16,64,64`); `what` names the expected layout in
/// the error.
fn parse_shape(text: &str, what: &str) -> anyhow::Result<Vec<usize>> {
    use anyhow::Context;
    text.split(',')
        .map(|d| d.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("--shape {text:?} is not {what}"))
}

/// Runs the command on this process's arguments; the exit code says whether it succeeded.
pub fn main() -> ExitCode {
    // First thing, while this is the only thread: glibc maps large allocations and returns
    // them when freed; the rest from the environment.
    let init = crate::init(crate::Config::default());
    let cli = Cli::parse();
    let default_level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    if let Err(e) = init {
        tracing::warn!("{e}");
    }

    let result = match cli.command {
        Command::Demo(args) => demo::run(&args),
        Command::Decode(args) => model_cmds::decode(&args),
        Command::Encode(args) => model_cmds::encode(&args),
        Command::Inspect(args) => model_cmds::inspect(&args),
        Command::Plan(args) => plan_cmd::plan(&args),
        Command::Calibrate(args) => calibrate::calibrate(&args),
        Command::Serve(args) => serve::serve(&args),
        Command::Bench(which) => bench::run(&which),
        Command::Devices => devices(),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            // Said once per failure: a supervisor whose rank 0 reported it, and the other ranks
            // of a supervised group (rank 0 names the rank that failed first), stay quiet.
            if err.is::<ranks::AlreadyReported>() || crate::launch::is_supervised_non_owner() {
                tracing::debug!("{}", error_text(&err));
            } else {
                eprintln!("error: {}", error_text(&err));
            }
            ExitCode::FAILURE
        }
    }
}

/// `vae-parallel devices`.
fn devices() -> anyhow::Result<ExitCode> {
    use crate::tensor::Device;
    use crate::tensor::cuda::{embedded_modules, embedded_sm90a_modules, probe, resolve_device};

    println!("cpu       {} thread(s)", rayon::current_num_threads());
    match probe(0) {
        Err(reason) => println!("cuda      {reason}"),
        Ok(_) => {
            for ordinal in 0.. {
                match probe(ordinal) {
                    Ok(info) => println!(
                        "cuda:{ordinal}    {}, sm_{}{}, {:.1} GiB, {} SMs; peaks: {:.0} GB/s, {} f32, {} bf16 tensor",
                        info.name,
                        info.compute_capability.0,
                        info.compute_capability.1,
                        info.total_memory as f64 / (1u64 << 30) as f64,
                        info.multiprocessors,
                        info.peak_bandwidth() / 1e9,
                        info.peak_f32_flops().map_or("?".into(), |f| format!("{:.1} TFLOP/s", f / 1e12)),
                        info.peak_bf16_tensor_flops().map_or("?".into(), |f| format!("{:.0} TFLOP/s", f / 1e12)),
                    ),
                    Err(_) => break,
                }
            }
        }
    }
    let modules = embedded_modules();
    if modules.is_empty() {
        println!("kernels   none embedded in this build (run `cargo xtask kernels`, then build)");
    } else {
        let names: Vec<&str> = modules.iter().map(|m| m.name).collect();
        println!(
            "kernels   {} module(s) embedded (sm_90 cubin, compute_80/90 PTX): {}",
            modules.len(),
            names.join(", ")
        );
    }
    let hopper: Vec<&str> = embedded_sm90a_modules().iter().map(|m| m.name).collect();
    if !hopper.is_empty() {
        println!(
            "kernels   {} Hopper-only module(s) (sm_90a cubin, loaded on compute capability 9.0): {}",
            hopper.len(),
            hopper.join(", ")
        );
    }
    let (device, why) = resolve_device(Device::Cuda(0));
    println!("--device cuda runs on {device}{}", why.map(|w| format!(": {w}")).unwrap_or_default());
    Ok(ExitCode::SUCCESS)
}

/// An error and its causes on one line, as `{:#}` prints them but without a cause whose text the
/// line already holds (an error that prints its source as well as returning it would otherwise
/// say it twice: "x: No such file (os error 2): No such file (os error 2)"), the options it
/// names written as this command's flags (`` `shard_grid` `` → `--shard-grid`).
fn error_text(err: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in err.chain() {
        let part = cause.to_string();
        if text.is_empty() {
            text = part;
        } else if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
    }
    crate::settings::rename_options(&text, crate::settings::cli_flag)
}

#[cfg(test)]
mod tests {
    use super::error_text;

    #[test]
    fn a_cause_the_message_already_holds_is_said_once() {
        let os = std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let err = anyhow::Error::new(crate::io::IoError::Os { path: "z.npy".into(), source: os })
            .context("reading the latent");
        assert_eq!(error_text(&err), "reading the latent: z.npy: No such file or directory (os error 2)");
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_text(&plain), "outer: inner");
    }
}
