//! Decoded frames written as they arrive: the [`FrameSink`] behind `decode --stream`.
//!
//! A `.npy` output is one file sized for the whole video up front (its header first), each run
//! of frames written at its place as it comes, so the process never holds the video. A `.png`
//! output is one file per frame, encoded as soon as the frame arrives; `.mp4` and `.gif` one
//! video per batch item, each frame handed to its encoder (ffmpeg, the gif crate) as it
//! arrives. Every file is
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
use crate::video::{VideoWriter, rgb_frames, video_path};

/// The file types a streamed decode can write, by extension.
pub const STREAMED_EXTENSIONS: [&str; 4] = ["npy", "png", "mp4", "gif"];

enum Format {
    /// The staged `.npy` file and where its data starts.
    Npy {
        file: Option<(File, u64)>,
    },
    Png,
    /// One writer per video of the batch, at this many frames a second.
    Video {
        writers: Vec<VideoWriter>,
        fps: u32,
    },
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
    /// A sink writing to `path` as its extension says (`.npy`, `.png`, `.mp4` or `.gif`;
    /// videos at `fps` frames a second).
    pub fn new(path: &Path, fps: u32) -> Result<Self, IoError> {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
        let format = match ext.as_str() {
            "npy" => Format::Npy { file: None },
            "png" => Format::Png,
            "mp4" | "gif" if fps > 0 => Format::Video { writers: Vec::new(), fps },
            "mp4" | "gif" => return Err(IoError::Unsupported("`fps` must be at least 1".into())),
            _ => {
                return Err(IoError::Unsupported(format!("{} must end in .npy, .png, .mp4 or .gif", path.display())));
            }
        };
        Ok(Self { path: path.to_path_buf(), format, staged: Staged::new(), dims: Vec::new(), next: 0 })
    }

    /// The frames written so far.
    pub fn frames_written(&self) -> usize {
        self.next
    }

    /// The staged files, once every frame announced arrived (and every video encoder
    /// finished); commit them to put them in place.
    pub fn finish(mut self) -> Result<Staged, IoError> {
        if self.dims.len() != 5 || self.next != self.dims[2] {
            return Err(IoError::Unsupported(format!(
                "{}: the decode ended after {} of its frames",
                self.path.display(),
                self.next
            )));
        }
        if let Format::Video { writers, .. } = &mut self.format {
            for writer in writers.drain(..) {
                writer.finish()?;
            }
        }
        Ok(self.staged)
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
            let (handle, _) = self.staged.add_open(&self.path)?;
            let data_bytes = dims.iter().product::<usize>() as u64 * 4;
            handle.set_len(header.len() as u64 + data_bytes)?;
            handle.write_all_at(&header, 0)?;
            *file = Some((handle, header.len() as u64));
        }
        if let Format::Video { writers, fps } = &mut self.format {
            let [videos, c, _, h, w] = <[usize; 5]>::try_from(dims)?;
            if c != 3 {
                return Err(format!("a video needs 3 channels (RGB), the output has shape {dims:?}").into());
            }
            for v in 0..videos {
                let target = video_path(&self.path, videos, v);
                writers.push(VideoWriter::start(&mut self.staged, &target, w, h, *fps)?);
            }
        }
        Ok(())
    }

    fn frames(&mut self, first: usize, run: Tensor) -> Result<(), SinkError> {
        let chunk = &run;
        check_run(&self.dims, self.next, first, chunk)?;
        match &mut self.format {
            Format::Npy { file: Some((file, data_at)) } => write_npy(&self.dims, file, *data_at, first, chunk)?,
            Format::Npy { file: None } => return Err("frames before the output's shape".into()),
            Format::Png => self.write_png(first, chunk)?,
            Format::Video { writers, .. } => {
                for (v, writer) in writers.iter_mut().enumerate() {
                    for rgb in rgb_frames(chunk, v)? {
                        writer.push(&rgb)?;
                    }
                }
            }
        }
        self.next += chunk.dims()[2];
        Ok(())
    }
}

/// Frames `first..` (`chunk`, `[B, C, n, H, W]`) of an output of `dims` into a `.npy` file whose
/// data starts at `data_at`: one write per (batch item, channel), whose frames are contiguous.
fn write_npy(dims: &[usize], file: &File, data_at: u64, first: usize, chunk: &Tensor) -> Result<(), SinkError> {
    let [_, c, t, h, w] = <[usize; 5]>::try_from(dims)?;
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
