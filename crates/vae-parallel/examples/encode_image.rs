//! Encodes a PNG into a latent (the distribution's mean, as the pipelines normalise it) on 2
//! local ranks, and decodes it back to see what the VAE kept.
//!
//! cargo run --release --example encode_image -- MODEL_DIR IMAGE.png LATENT.npy
#![allow(clippy::print_stdout)] // an example program: the terminal is its own

use vae_parallel::{Decode, Encode, Error, Group, Vae, io};

fn main() -> vae_parallel::Result<()> {
    let [model, image, out] = args(["MODEL_DIR", "IMAGE.png", "LATENT.npy"])?;
    let vae = Vae::load(&model)?;
    let image = io::read_image(&image)?; // [1, 3, H, W] in [-1, 1]
    let group = Group::local(2)?;
    // Every rank receives the latent (the pipelines condition on it everywhere).
    let latent = group.encode(&vae, &image, &Encode::default().pipeline_latents())?.expect("rank 0 holds it");
    io::write_npy(&out, &latent)?;
    let back = group.decode(&vae, &latent, &Decode::default().pipeline_latents())?.expect("rank 0 holds it");
    let error = back.max_abs_diff(&image)?;
    println!("{:?} -> latent {:?} -> {:?}; largest pixel error {error:.3}", image.dims(), latent.dims(), back.dims());
    Ok(())
}

/// The command line's arguments, named in the error when one is missing.
fn args<const N: usize>(names: [&str; N]) -> vae_parallel::Result<[String; N]> {
    let given: Vec<String> = std::env::args().skip(1).collect();
    let usage = || Error::invalid_option(format!("usage: {}", names.join(" ")));
    given.try_into().map_err(|_| usage())
}
