//! The README's quick start, as a newcomer copies it: the Rust program is the `quickstart`
//! example's (which CI runs), and the CLI's commands run as written from the repository's root.

mod support;

use std::path::Path;
use std::process::Command;

fn repository() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn readme() -> String {
    std::fs::read_to_string(repository().join("README.md")).unwrap()
}

/// The body of the first fenced block of `language` after `marker`.
fn block_after(text: &str, marker: &str, language: &str) -> String {
    let start = text.find(marker).unwrap_or_else(|| panic!("no {marker:?} in the README"));
    let fence = format!("```{language}\n");
    let open = start + text[start..].find(&fence).unwrap() + fence.len();
    let close = open + text[open..].find("```").unwrap();
    text[open..close].to_string()
}

#[test]
fn the_first_lines_are_the_demo_and_the_tests() {
    let text = readme();
    let first = block_after(&text, "# vae-parallel", "bash");
    let commands: Vec<&str> = first.lines().map(|l| l.split('#').next().unwrap().trim()).collect();
    assert_eq!(commands, ["cargo run --release -p vae-parallel -- demo", "cargo test --workspace"]);
    let quick_start = text.find("## Quick start").unwrap();
    let rust_end = quick_start + text[quick_start..].find("```rust").unwrap();
    assert!(text[..rust_end].lines().count() < 80, "the three quick starts begin within the first 80 lines");
    assert!(text.split_whitespace().count() <= 1500, "the README stays short");
}

#[test]
fn the_rust_quick_start_is_the_example_ci_runs() {
    let shown = block_after(&readme(), "**Rust**", "rust");
    let example = std::fs::read_to_string(repository().join("crates/vae-parallel/examples/quickstart.rs")).unwrap();
    let code: String = example.lines().skip_while(|l| l.starts_with("//!")).map(|l| format!("{l}\n")).collect();
    assert_eq!(shown, code, "the README's Rust block and examples/quickstart.rs differ");
}

#[test]
fn the_cli_quick_start_runs_as_written() {
    let dir = support::scratch("readme-cli");
    std::os::unix::fs::symlink(repository().join("fixtures").canonicalize().unwrap(), dir.join("fixtures")).unwrap();
    let block = block_after(&readme(), "**CLI.**", "bash");
    let mut ran = 0;
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let args = line.strip_prefix("cargo run --release -p vae-parallel -- ").unwrap_or_else(|| panic!("{line}"));
        let out = Command::new(env!("CARGO_BIN_EXE_vae-parallel"))
            .args(args.split_whitespace())
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{line}\n{}", String::from_utf8_lossy(&out.stderr));
        ran += 1;
    }
    assert_eq!(ran, 2);
    assert!(std::fs::metadata(dir.join("cat.png")).unwrap().len() > 10_000);
    std::fs::remove_dir_all(&dir).unwrap();
}
