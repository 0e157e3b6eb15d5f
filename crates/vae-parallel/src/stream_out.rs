//! Decoded frames written as they arrive: the [`FrameSink`] behind `decode --stream`.
//!
//! A `.npy` output is one file sized for the whole video up front (its header first), each run
//! of frames written at its place as it comes, so the process never holds the video. A `.png`
//! output is one file per frame, encoded as soon as the frame arrives. Either way every file is
//! staged next to its target ([`Staged`]) and only put in place by the caller's commit once the
//! whole request has succeeded: a failure mid-stream leaves nothing under the final names.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use vae_runtime::stream::check_run;
use vae_runtime::{FrameSink, SinkError};
use vae_tensor::Tensor;

use crate::io::{self, IoError};
use crate::output::Staged;

/// The file types a streamed decode can write, by extension.
pub const STREAMED_EXTENSIONS: [&str; 2] = ["npy", "png"];

enum Format {
    /// The staged `.npy` file and where its data starts.
    Npy { file: Option<(File, u64)> },
    Png,
}

/// Writes a streamed decode's frames to `.npy` or `.png` files, staged until committed.
pub struct StreamedOutput {
    path: PathBuf,
    format: Format,
    staged: Staged,
    dims: Vec<usize>,
    next: usize,
}

impl StreamedOutput {
    /// A sink writing to `path` as its extension says (`.npy` or `.png`).
    pub fn new(path: &Path) -> Result<Self, IoError> {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
        let format = match ext.as_str() {
            "npy" => Format::Npy { file: None },
            "png" => Format::Png,
            _ => {
                return Err(IoError::Unsupported(format!(
                    "{}: a streamed decode writes .npy or .png (one file per frame); decode without \
                     streaming for .mp4 or .gif",
                    path.display()
                )));
            }
        };
        Ok(Self { path: path.to_path_buf(), format, staged: Staged::new(), dims: Vec::new(), next: 0 })
    }

    /// The frames written so far.
    pub fn frames_written(&self) -> usize {
        self.next
    }

    /// The staged files, once every frame announced arrived; commit them to put them in place.
    pub fn finish(self) -> Result<Staged, IoError> {
        if self.dims.len() != 5 || self.next != self.dims[2] {
            return Err(IoError::Unsupported(format!(
                "{}: the decode ended after {} of its frames",
                self.path.display(),
                self.next
            )));
        }
        Ok(self.staged)
    }

    fn write_npy(&self, file: &File, data_at: u64, first: usize, chunk: &Tensor) -> Result<(), SinkError> {
        let [_, c, t, h, w] = <[usize; 5]>::try_from(self.dims.as_slice())?;
        let n = chunk.dims()[2];
        let values = chunk.as_slice_f32()?;
        let run = n * h * w;
        let mut bytes = Vec::with_capacity(run * 4);
        // Each (batch item, channel) holds its frames contiguously: one write per pair.
        for (bc, src) in values.chunks_exact(run).enumerate() {
            bytes.clear();
            bytes.extend(src.iter().flat_map(|v| v.to_le_bytes()));
            let (b, ch) = (bc / c, bc % c);
            let at = (((b * c + ch) * t + first) * h * w * 4) as u64;
            file.write_all_at(&bytes, data_at + at)?;
        }
        Ok(())
    }

    fn write_png(&mut self, first: usize, chunk: &Tensor) -> Result<(), SinkError> {
        let [videos, c, n, h, w] = <[usize; 5]>::try_from(chunk.dims())?;
        for b in 0..videos {
            for i in 0..n {
                let frame = chunk.narrow(0, b, 1)?.narrow(2, i, 1)?.reshape(vec![c, h, w])?;
                let target = io::video_frame_path(&self.path, videos, b, first + i);
                self.staged.add(&target, &io::png_bytes(&frame)?)?;
            }
        }
        Ok(())
    }
}

impl FrameSink for StreamedOutput {
    fn begin(&mut self, dims: &[usize]) -> Result<(), SinkError> {
        self.dims = dims.to_vec();
        if let Format::Npy { file } = &mut self.format {
            let header = io::npy_header(dims);
            let handle = self.staged.add_open(&self.path)?;
            let data_bytes = dims.iter().product::<usize>() as u64 * 4;
            handle.set_len(header.len() as u64 + data_bytes)?;
            handle.write_all_at(&header, 0)?;
            *file = Some((handle, header.len() as u64));
        }
        Ok(())
    }

    fn frames(&mut self, first: usize, chunk: &Tensor) -> Result<(), SinkError> {
        check_run(&self.dims, self.next, first, chunk)?;
        match &self.format {
            Format::Npy { file: Some((file, data_at)) } => self.write_npy(file, *data_at, first, chunk)?,
            Format::Npy { file: None } => return Err("frames before the output's shape".into()),
            Format::Png => self.write_png(first, chunk)?,
        }
        self.next += chunk.dims()[2];
        Ok(())
    }
}
