//! The `vae-parallel` command ([`vae_parallel::cli::main`]).

fn main() -> std::process::ExitCode {
    vae_parallel::cli::main()
}
