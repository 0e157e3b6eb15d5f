//! One rank of a group of processes, as torchrun (or any launcher) starts them: every process
//! loads the model and makes the same request; rank 0 writes the image.
//!
//! torchrun --nproc-per-node 2 target/release/examples/multiprocess MODEL_DIR LATENT.npy OUT.png
//! (or VAE_RANK=r VAE_WORLD_SIZE=2 VAE_MASTER_ADDR=unix:/tmp/vae.sock per process; over TCP the
//! processes share a secret in VAE_GROUP_SECRET).
#![allow(clippy::print_stdout)] // an example program: the terminal is its own

use vae_parallel::{Decode, Error, Group, Vae, io};

fn main() -> vae_parallel::Result<()> {
    let [model, latent, out] = args(["MODEL_DIR", "LATENT.npy", "OUT.png"])?;
    let group = Group::from_env()?; // returns once every rank has joined
    let vae = Vae::load(&model)?;
    let latent = io::read_tensor(&latent)?;
    // Every rank computes its part; the pixels arrive on the owner only.
    if let Some(image) = group.decode(&vae, &latent, &Decode::default())? {
        io::write_decoded(&out, &image, 16)?;
        println!("rank {} of {}: wrote {out}", group.rank(), group.size());
    }
    Ok(())
}

/// The command line's arguments, named in the error when one is missing.
fn args<const N: usize>(names: [&str; N]) -> vae_parallel::Result<[String; N]> {
    let given: Vec<String> = std::env::args().skip(1).collect();
    given.try_into().map_err(|_| Error::invalid_option(format!("usage: {}", names.join(" "))))
}
