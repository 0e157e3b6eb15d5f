//! The `vae-parallel` command in the wheel: the library's command line
//! ([`vae_parallel::cli::main`]), built from this package so that the release tree compiles once
//! for the extension and the command (see the `command` feature in Cargo.toml).

fn main() -> std::process::ExitCode {
    vae_parallel::cli::main()
}
