//! Decodes a latent into a PNG on 4 local ranks: diffusers' untiled decode, split exactly.
//!
//! cargo run --release --example decode_image -- MODEL_DIR LATENT.npy OUT.png
#![allow(clippy::print_stdout)] // an example program: the terminal is its own

use vae_parallel::{Decode, Error, Group, Vae, io};

fn main() -> vae_parallel::Result<()> {
    let [model, latent, out] = args(["MODEL_DIR", "LATENT.npy", "OUT.png"])?;
    let vae = Vae::load(&model)?;
    let latent = io::read_tensor(&latent)?;
    let group = Group::local(4)?;
    // Some(pixels) on the owner (rank 0), in [-1, 1], as `vae.decode(z).sample`.
    let image = group.decode(&vae, &latent, &Decode::default())?.expect("a local group returns rank 0's output");
    for path in io::write_decoded(&out, &image, 16)? {
        println!("wrote {} ({:?})", path.display(), image.dims());
    }
    Ok(())
}

/// The command line's arguments, named in the error when one is missing.
fn args<const N: usize>(names: [&str; N]) -> vae_parallel::Result<[String; N]> {
    let given: Vec<String> = std::env::args().skip(1).collect();
    let usage = || Error::invalid_option(format!("usage: {}", names.join(" ")));
    given.try_into().map_err(|_| usage())
}
