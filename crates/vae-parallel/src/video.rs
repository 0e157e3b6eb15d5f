//! Decoded videos as files a player opens: MP4 (H.264 in yuv420p, encoded by an `ffmpeg` the
//! user has: on `PATH` or named by `VAE_FFMPEG`) and GIF (encoded here, no program needed).
//! Frames are diffusers' post-processing of the decoded pixels (see
//! [`crate::io::postprocess_image`]); files are staged like every output, in place only once
//! the whole request succeeded.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::io::{IoError, postprocess_image};
use crate::output::Staged;
use vae_tensor::Tensor;

/// Environment variable: the `ffmpeg` program MP4 output runs (default: `ffmpeg` on `PATH`).
pub const ENV_FFMPEG: &str = "VAE_FFMPEG";

/// Frames per second when none is given: the Wan pipelines' examples export at 16.
pub const DEFAULT_FPS: u32 = 16;

/// The file types [`stage_video_batch`] writes, by extension.
pub const VIDEO_EXTENSIONS: [&str; 2] = ["mp4", "gif"];

/// One video's frames: RGB, 8 bits, `w × h`.
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
    let unsupported = |e: vae_tensor::TensorError| IoError::Unsupported(e.to_string());
    // [B, C, T, H, W] → [B·T, C, H, W], frames in order.
    let frames = batch.reshape(vec![b, c, t, h, w]).and_then(|x| x.permute(&[0, 2, 1, 3, 4])).map_err(unsupported)?;
    let frames = frames.reshape(vec![b * t, c, h, w]).map_err(unsupported)?;
    (0..b)
        .map(|v| {
            let rgb = (0..t)
                .map(|i| {
                    let one =
                        frames.narrow(0, v * t + i, 1).and_then(|f| f.reshape(vec![c, h, w])).map_err(unsupported)?;
                    Ok(postprocess_image(&one)?.3)
                })
                .collect::<Result<_, IoError>>()?;
            Ok(Frames { w, h, rgb })
        })
        .collect()
}

/// Stages every video of a decoded batch at `path` (`.mp4` or `.gif`): `out.mp4` for one video,
/// `out_0000.mp4`, `out_0001.mp4`, … for several.
pub fn stage_video_batch(staged: &mut Staged, path: &Path, batch: &Tensor, fps: u32) -> Result<(), IoError> {
    if fps == 0 {
        return Err(IoError::Unsupported("--fps must be at least 1".into()));
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    let videos = videos(batch)?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("video").to_string();
    let named = |i: usize| -> PathBuf {
        if videos.len() == 1 { path.to_path_buf() } else { path.with_file_name(format!("{stem}_{i:04}.{ext}")) }
    };
    for (i, video) in videos.iter().enumerate() {
        match ext.as_str() {
            "mp4" => staged.add_written_by(&named(i), |at| encode_mp4(video, fps, at))?,
            "gif" => staged.add(&named(i), &encode_gif(video, fps)?)?,
            _ => return Err(IoError::Unsupported(format!("{} is not a .mp4 or .gif file", path.display()))),
        }
    }
    Ok(())
}

/// The `ffmpeg` to run: `VAE_FFMPEG`, else `ffmpeg` (looked up on `PATH`).
fn ffmpeg() -> PathBuf {
    std::env::var_os(ENV_FFMPEG).filter(|v| !v.is_empty()).map_or_else(|| PathBuf::from("ffmpeg"), PathBuf::from)
}

/// H.264 in yuv420p (what every player takes; an odd width or height gets one black column or
/// row), written by ffmpeg to `at`.
fn encode_mp4(video: &Frames, fps: u32, at: &Path) -> Result<(), IoError> {
    let program = ffmpeg();
    let mut child = Command::new(&program)
        .args(["-hide_banner", "-loglevel", "error", "-nostdin", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24"])
        .args(["-s", &format!("{}x{}", video.w, video.h), "-r", &fps.to_string(), "-i", "pipe:0"])
        .args(["-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2", "-c:v", "libx264", "-pix_fmt", "yuv420p"])
        .args(["-movflags", "+faststart", "-f", "mp4"])
        .arg(at)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            IoError::Unsupported(format!(
                "MP4 output needs ffmpeg, and {} could not be run ({e}): install ffmpeg or name it in {ENV_FFMPEG} \
                 (or write .gif, or .png frames)",
                program.display()
            ))
        })?;
    // ffmpeg reads every frame before it writes much to stderr (errors only), so writing all
    // frames first and reading stderr after cannot deadlock on the pipes.
    let written = {
        let mut stdin = child.stdin.take().expect("stdin is piped");
        video.rgb.iter().try_for_each(|frame| stdin.write_all(frame))
    };
    let out = child.wait_with_output().map_err(|e| IoError::Unsupported(format!("waiting for ffmpeg: {e}")))?;
    if !out.status.success() || written.is_err() {
        let said = String::from_utf8_lossy(&out.stderr);
        let said = said.lines().last().unwrap_or("").trim();
        return Err(IoError::Unsupported(format!("ffmpeg failed ({}): {said}", out.status)));
    }
    Ok(())
}

/// An endlessly looping GIF; each frame quantised to its own 256-colour palette.
fn encode_gif(video: &Frames, fps: u32) -> Result<Vec<u8>, IoError> {
    let too_big =
        || IoError::Unsupported(format!("a GIF is at most 65535 pixels wide and high, not {}x{}", video.w, video.h));
    let (w, h) = (u16::try_from(video.w).map_err(|_| too_big())?, u16::try_from(video.h).map_err(|_| too_big())?);
    let gif_err = |e: gif::EncodingError| IoError::Unsupported(format!("encoding the GIF: {e}"));
    let mut out = Vec::new();
    {
        let mut encoder = gif::Encoder::new(&mut out, w, h, &[]).map_err(gif_err)?;
        encoder.set_repeat(gif::Repeat::Infinite).map_err(gif_err)?;
        // GIF delays are in hundredths of a second.
        let delay = (100.0 / f64::from(fps)).round().max(1.0) as u16;
        for rgb in &video.rgb {
            let mut frame = gif::Frame::from_rgb_speed(w, h, rgb, 10);
            frame.delay = delay;
            encoder.write_frame(&frame).map_err(gif_err)?;
        }
    }
    Ok(out)
}
