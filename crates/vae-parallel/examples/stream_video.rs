//! Decodes a video latent on 2 local ranks and writes each frame as a PNG the moment it is
//! decoded: memory does not grow with the frame count, and the frames are the whole decode's.
//!
//! cargo run --release --example stream_video -- MODEL_DIR LATENT.npy OUT_DIR
#![allow(clippy::print_stdout)] // an example program: the terminal is its own

use std::path::PathBuf;

use vae_parallel::{Decode, Error, FrameSink, Group, SinkError, Tensor, Vae, io};

/// Writes `OUT_DIR/frame_0000.png`, … as runs of frames `[B, 3, n, H, W]` arrive.
struct Pngs(PathBuf);

impl FrameSink for Pngs {
    fn begin(&mut self, _dims: &[usize]) -> Result<(), SinkError> {
        Ok(std::fs::create_dir_all(&self.0)?)
    }
    fn frames(&mut self, first: usize, run: Tensor) -> Result<(), SinkError> {
        for t in 0..run.dims()[2] {
            let frame = run.narrow(2, t, 1)?.narrow(0, 0, 1)?.reshape(vec![3, run.dims()[3], run.dims()[4]])?;
            let path = self.0.join(format!("frame_{:04}.png", first + t));
            std::fs::write(&path, io::png_bytes(&frame)?)?;
            println!("wrote {}", path.display());
        }
        Ok(())
    }
}

fn main() -> vae_parallel::Result<()> {
    let [model, latent, out] = args(["MODEL_DIR", "LATENT.npy", "OUT_DIR"])?;
    let (vae, latent) = (Vae::load(&model)?, io::read_tensor(&latent)?);
    Group::local(2)?.decode_to(&vae, &latent, &Decode::default(), &mut Pngs(out.into()))
}

/// The command line's arguments, named in the error when one is missing.
fn args<const N: usize>(names: [&str; N]) -> vae_parallel::Result<[String; N]> {
    let given: Vec<String> = std::env::args().skip(1).collect();
    given.try_into().map_err(|_| Error::invalid_option(format!("usage: {}", names.join(" "))))
}
