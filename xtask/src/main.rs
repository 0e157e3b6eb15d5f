//! Repository tasks, run as `cargo xtask <task>`.
//!
//! - `ci`: what `.ci/run` checks — formatting, clippy with warnings denied, the test suite.
//! - `bench`: the transport and failure-detection benchmarks of the CLI, in release mode, for
//!   the rank counts the reports quote.

#![allow(clippy::print_stdout, clippy::print_stderr)] // a terminal tool

use std::process::Command;

use anyhow::{Context, bail};

const USAGE: &str = "usage: cargo xtask <ci | bench>";

fn main() -> anyhow::Result<()> {
    let task = std::env::args().nth(1);
    match task.as_deref() {
        Some("ci") => ci(),
        Some("bench") => bench(),
        Some("-h" | "--help") | None => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => bail!("unknown task {other:?}\n{USAGE}"),
    }
}

fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    eprintln!("$ {program} {}", args.join(" "));
    let status = Command::new(program).args(args).status().with_context(|| format!("starting {program}"))?;
    if !status.success() {
        bail!("{program} {} failed with {status}", args.join(" "));
    }
    Ok(())
}

fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run(&std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()), args)
}

fn ci() -> anyhow::Result<()> {
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    cargo(&["test", "--workspace"])
}

fn bench() -> anyhow::Result<()> {
    cargo(&["build", "--release", "-p", "vae-parallel"])?;
    let exe = "target/release/vae-parallel";
    for (transport, ranks) in [("socket", "2"), ("socket", "4"), ("local", "4")] {
        run(exe, &["bench", "transport", "--transport", transport, "--ranks", ranks, "--mib", "32", "--iters", "5"])?;
    }
    for transport in ["socket", "local"] {
        run(exe, &["bench", "failover", "--transport", transport, "--ranks", "4"])?;
    }
    run(exe, &["demo", "--ranks", "4", "--work-ms", "20"])
}
