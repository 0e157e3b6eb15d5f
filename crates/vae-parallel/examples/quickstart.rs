//! The README's Rust quick start: the demo VAE encodes a photo and decodes it on 4 local ranks.
//!
//! cargo run --release --example quickstart     (from the repository's root)
use vae_parallel::{Decode, Encode, Group, Vae, io};

fn main() -> vae_parallel::Result<()> {
    let vae = Vae::load("fixtures/demo_vae")?;
    let group = Group::local(4)?;
    let photo = io::read_image("fixtures/demo_vae/chelsea_256.png")?;
    let latent = group.encode(&vae, &photo, &Encode::default())?.expect("every rank gets the latent");
    let image = group.decode(&vae, &latent, &Decode::default())?.expect("rank 0 gets the pixels");
    io::write_decoded("quickstart.png", &image, 16)?;
    Ok(())
}
