//! Decoded videos as files a player opens: MP4 (H.264 in yuv420p, encoded by an `ffmpeg` the
//! user has: on `PATH` or named by `VAE_FFMPEG`) and GIF (encoded here, no program needed).
//! Frames are diffusers' post-processing of the decoded pixels (see
//! [`crate::io::postprocess_image`]); files are staged like every output, in place only once
//! the whole request succeeded.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

use crate::io::{IoError, postprocess_image};
use crate::output::Staged;
use vae_tensor::Tensor;

/// Environment variable: the `ffmpeg` program MP4 output runs (default: `ffmpeg` on `PATH`).
pub const ENV_FFMPEG: &str = "VAE_FFMPEG";

/// Frames per second when none is given: the Wan pipelines' examples export at 16.
pub const DEFAULT_FPS: u32 = 16;

/// The file types [`stage_video_batch`] writes, by extension.
pub const VIDEO_EXTENSIONS: [&str; 2] = ["mp4", "gif"];

/// The RGB frames (8 bits, `w × h`) of one video of a decoded batch, in order.
struct Frames {
    w: usize,
    h: usize,
    rgb: Vec<Vec<u8>>,
}

/// The videos of a decoded batch: `[B, 3, T, H, W]` gives B videos of T frames, an image batch
/// `[B, 3, H, W]` B one-frame videos.
fn videos(batch: &Tensor) -> Result<Vec<Frames>, IoError> {
    let d = batch.dims().to_vec();
    let (b, c, t, h, w) = match d[..] {
        [b, c, t, h, w] => (b, c, t, h, w),
        [b, c, h, w] => (b, c, 1, h, w),
        _ => return Err(IoError::Unsupported(format!("cannot write a tensor of shape {d:?} as a video"))),
    };
    if c != 3 {
        return Err(IoError::Unsupported(format!("a video needs 3 channels (RGB), the output has shape {d:?}")));
    }
    let video = batch.reshape(vec![b, c, t, h, w]).map_err(unsupported)?;
    (0..b).map(|v| Ok(Frames { w, h, rgb: rgb_frames(&video, v)? })).collect()
}

fn unsupported(e: vae_tensor::TensorError) -> IoError {
    IoError::Unsupported(e.to_string())
}

/// Video `v` of `[B, 3, T, H, W]` pixels in [-1, 1] as 8-bit RGB frames (diffusers'
/// post-processing).
pub(crate) fn rgb_frames(batch: &Tensor, v: usize) -> Result<Vec<Vec<u8>>, IoError> {
    let [_, c, t, h, w] = <[usize; 5]>::try_from(batch.dims())
        .map_err(|_| IoError::Unsupported(format!("{:?} is not [B, 3, T, H, W]", batch.dims())))?;
    (0..t)
        .map(|i| {
            let one = batch.narrow(0, v, 1).and_then(|x| x.narrow(2, i, 1)).and_then(|f| f.reshape(vec![c, h, w]));
            Ok(postprocess_image(&one.map_err(unsupported)?)?.3)
        })
        .collect()
}

/// Where video `i` of a batch of `count` goes: `out.mp4` for one, `out_0000.mp4`, … for several.
pub(crate) fn video_path(path: &Path, count: usize, i: usize) -> PathBuf {
    if count == 1 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("video");
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    path.with_file_name(format!("{stem}_{i:04}.{ext}"))
}

/// Stages every video of a decoded batch at `path` (`.mp4` or `.gif`): `out.mp4` for one video,
/// `out_0000.mp4`, `out_0001.mp4`, … for several.
pub fn stage_video_batch(staged: &mut Staged, path: &Path, batch: &Tensor, fps: u32) -> Result<(), IoError> {
    let videos = videos(batch)?;
    for (i, video) in videos.iter().enumerate() {
        let mut writer = VideoWriter::start(staged, &video_path(path, videos.len(), i), video.w, video.h, fps)?;
        for frame in &video.rgb {
            writer.push(frame)?;
        }
        writer.finish()?;
    }
    Ok(())
}

/// The `ffmpeg` to run: `VAE_FFMPEG`, else `ffmpeg` (looked up on `PATH`).
fn ffmpeg() -> PathBuf {
    std::env::var_os(ENV_FFMPEG).filter(|v| !v.is_empty()).map_or_else(|| PathBuf::from("ffmpeg"), PathBuf::from)
}

/// One video being written a frame at a time into a file staged for its target: MP4 through a
/// running ffmpeg, GIF by the gif crate. A streamed decode keeps one per video and pushes
/// frames as they are decoded; nothing of the video is held here.
pub(crate) struct VideoWriter {
    target: PathBuf,
    kind: Writer,
}

enum Writer {
    /// ffmpeg reading raw frames on stdin; its messages go to a file (a pipe nobody reads while
    /// frames are written could fill and stall it).
    Mp4 { child: Child, stdin: Option<ChildStdin>, stderr: File },
    /// The GIF encoder and each frame's delay.
    Gif { encoder: Option<gif::Encoder<BufWriter<File>>>, size: (u16, u16), delay: u16 },
}

impl VideoWriter {
    /// Stages `target` (`.mp4` or `.gif`) for a `w × h` video at `fps` frames a second.
    pub(crate) fn start(staged: &mut Staged, target: &Path, w: usize, h: usize, fps: u32) -> Result<Self, IoError> {
        if fps == 0 {
            return Err(IoError::Unsupported("`fps` must be at least 1".into()));
        }
        let ext = target.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
        let kind = match ext.as_str() {
            "mp4" => {
                let (_, at) = staged.add_open(target)?;
                start_mp4(w, h, fps, &at)?
            }
            "gif" => {
                let too_big =
                    || IoError::Unsupported(format!("a GIF is at most 65535 pixels wide and high, not {w}x{h}"));
                let size = (u16::try_from(w).map_err(|_| too_big())?, u16::try_from(h).map_err(|_| too_big())?);
                let (file, _) = staged.add_open(target)?;
                let mut encoder = gif::Encoder::new(BufWriter::new(file), size.0, size.1, &[]).map_err(gif_err)?;
                encoder.set_repeat(gif::Repeat::Infinite).map_err(gif_err)?;
                // GIF delays are in hundredths of a second.
                let delay = (100.0 / f64::from(fps)).round().max(1.0) as u16;
                Writer::Gif { encoder: Some(encoder), size, delay }
            }
            _ => return Err(IoError::Unsupported(format!("{} is not a .mp4 or .gif file", target.display()))),
        };
        Ok(Self { target: target.to_path_buf(), kind })
    }

    /// Appends one RGB frame (`w · h · 3` bytes).
    pub(crate) fn push(&mut self, rgb: &[u8]) -> Result<(), IoError> {
        match &mut self.kind {
            Writer::Mp4 { stdin, .. } => {
                let pipe = stdin.as_mut().ok_or_else(|| IoError::Unsupported("ffmpeg's input is closed".into()))?;
                if pipe.write_all(rgb).is_err() {
                    // ffmpeg stopped reading: its own message says why.
                    drop(stdin.take());
                    return Err(self.mp4_failure());
                }
                Ok(())
            }
            Writer::Gif { encoder, size, delay } => {
                let encoder = encoder.as_mut().ok_or_else(|| IoError::Unsupported("the GIF is finished".into()))?;
                let mut frame = gif::Frame::from_rgb_speed(size.0, size.1, rgb, 10);
                frame.delay = *delay;
                encoder.write_frame(&frame).map_err(gif_err)
            }
        }
    }

    /// Ends the video: ffmpeg finishes the file (an error if it failed), the GIF gets its
    /// trailer.
    pub(crate) fn finish(mut self) -> Result<(), IoError> {
        match &mut self.kind {
            Writer::Mp4 { stdin, child, .. } => {
                drop(stdin.take());
                let status = child.wait().map_err(|e| IoError::Unsupported(format!("waiting for ffmpeg: {e}")))?;
                if status.success() { Ok(()) } else { Err(self.mp4_failure()) }
            }
            Writer::Gif { encoder, .. } => {
                let encoder = encoder.take().ok_or_else(|| IoError::Unsupported("the GIF is finished".into()))?;
                let mut out = encoder.into_inner().map_err(gif_err)?;
                out.flush().map_err(|e| os_err(&self.target, e))
            }
        }
    }

    /// ffmpeg's failure, in its last line of output (after waiting for it to exit).
    fn mp4_failure(&mut self) -> IoError {
        let Writer::Mp4 { child, stderr, .. } = &mut self.kind else {
            return IoError::Unsupported("not an MP4 writer".into());
        };
        let status = child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
        let mut said = String::new();
        let _ = stderr.seek(SeekFrom::Start(0)).and_then(|_| stderr.read_to_string(&mut said));
        let said = said.lines().last().unwrap_or("").trim();
        IoError::Unsupported(format!("ffmpeg failed ({status}): {said}"))
    }
}

impl Drop for VideoWriter {
    fn drop(&mut self) {
        // An unfinished MP4 (a failed request): stop ffmpeg rather than leave it waiting.
        if let Writer::Mp4 { child, stdin, .. } = &mut self.kind
            && stdin.take().is_some()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn gif_err(e: gif::EncodingError) -> IoError {
    IoError::Unsupported(format!("encoding the GIF: {e}"))
}

fn os_err(path: &Path, source: std::io::Error) -> IoError {
    IoError::Os { path: path.to_path_buf(), source }
}

/// ffmpeg encoding raw RGB frames from its stdin into H.264 in yuv420p at `at` (what every
/// player takes; an odd width or height gets one black column or row).
fn start_mp4(w: usize, h: usize, fps: u32, at: &Path) -> Result<Writer, IoError> {
    let program = ffmpeg();
    let stderr = tempfile::tempfile().map_err(|e| os_err(at, e))?;
    let mut child = Command::new(&program)
        .args(["-hide_banner", "-loglevel", "error", "-nostdin", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24"])
        .args(["-s", &format!("{w}x{h}"), "-r", &fps.to_string(), "-i", "pipe:0"])
        .args(["-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2", "-c:v", "libx264", "-pix_fmt", "yuv420p"])
        .args(["-movflags", "+faststart", "-f", "mp4"])
        .arg(at)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr.try_clone().map_err(|e| os_err(at, e))?))
        .spawn()
        .map_err(|e| {
            IoError::Unsupported(format!(
                "MP4 output needs ffmpeg, and {} could not be run ({e}): install ffmpeg or name it in {ENV_FFMPEG} \
                 (or write .gif, or .png frames)",
                program.display()
            ))
        })?;
    let stdin = child.stdin.take();
    Ok(Writer::Mp4 { child, stdin, stderr })
}
