//! The `vae-parallel` command line.

#![allow(clippy::print_stdout, clippy::print_stderr)] // the CLI owns the terminal

mod bench;
mod demo;
mod model_cmds;
mod ranks;

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
    /// Run the tile executor across ranks on a built-in synthetic decoder (no downloads) and
    /// check the result is bit-identical to one rank.
    Demo(demo::DemoArgs),
    /// Decode a latent with a diffusers VAE.
    Decode(model_cmds::DecodeArgs),
    /// Encode an image with a diffusers VAE.
    Encode(model_cmds::EncodeArgs),
    /// Describe a diffusers VAE directory.
    Inspect(model_cmds::InspectArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();

    let result = match cli.command {
        Command::Demo(args) => demo::run(&args),
        Command::Decode(args) => model_cmds::decode(&args),
        Command::Encode(args) => model_cmds::encode(&args),
        Command::Inspect(args) => model_cmds::inspect(&args),
        Command::Bench(which) => bench::run(&which),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
