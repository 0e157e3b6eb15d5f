//! Decoded videos written as `.gif` and `.mp4` by the CLI, read back by a decoder of their own
//! (the gif crate's, ffprobe): frame count, size and rate; and a clear error, with nothing
//! written, where MP4 output has no ffmpeg to run.
#![allow(clippy::print_stderr)] // a test skipped for want of ffmpeg says so

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::{cli, cli_with_env, read_npy_f32, s, scratch, wan21_fixture};

/// The Wan2.1 fixture's decode as `.npy`: `(frames, height, width)` and the values.
fn reference_decode(dir: &Path) -> ((usize, usize, usize), Vec<f32>) {
    let (model, latent) = wan21_fixture();
    let out = dir.join("ref.npy");
    let (ok, text) = cli(&["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out)]);
    assert!(ok, "{text}");
    let bytes = std::fs::read(&out).unwrap();
    let header =
        String::from_utf8_lossy(&bytes[10..10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize]).to_string();
    let shape: Vec<usize> = header
        .split("'shape': (")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap()
        .split(',')
        .filter_map(|d| d.trim().parse().ok())
        .collect();
    assert_eq!(shape.len(), 5, "{header}");
    ((shape[2], shape[3], shape[4]), read_npy_f32(&out))
}

#[test]
fn a_video_decodes_to_a_gif_of_every_frame() {
    let dir = scratch("gif");
    let ((t, h, w), values) = reference_decode(&dir);
    let (model, latent) = wan21_fixture();
    let out = dir.join("clip.gif");
    let (ok, text) = cli(&["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out), "--fps", "8"]);
    assert!(ok, "{text}");

    let mut options = gif::DecodeOptions::new();
    options.set_color_output(gif::ColorOutput::RGBA);
    let mut decoder = options.read_info(std::fs::File::open(&out).unwrap()).unwrap();
    assert_eq!((decoder.width() as usize, decoder.height() as usize), (w, h));
    let mut frames = 0;
    while let Some(frame) = decoder.read_next_frame().unwrap() {
        assert_eq!(frame.delay, 13, "8 frames per second: 12.5 hundredths, rounded");
        // Each pixel is the decoded value's 8-bit rendering, up to the 256-colour palette.
        let plane = h * w;
        let mut err = 0.0f64;
        for i in 0..plane {
            for c in 0..3 {
                let v = values[(c * t + frames) * plane + i];
                let want = ((v / 2.0 + 0.5).clamp(0.0, 1.0) * 255.0).round();
                err += (f64::from(frame.buffer[4 * i + c]) - f64::from(want)).abs();
            }
        }
        let mean = err / (3 * plane) as f64;
        assert!(mean < 12.0, "frame {frames}: mean error {mean} levels");
        frames += 1;
    }
    assert_eq!(frames, t, "one GIF frame per decoded frame");
}

/// ffmpeg and ffprobe, if this machine has them (CI installs them).
fn ffmpeg_tools() -> bool {
    let runs = |p: &str| Command::new(p).arg("-version").output().is_ok_and(|o| o.status.success());
    runs("ffmpeg") && runs("ffprobe")
}

#[test]
fn a_video_decodes_to_an_mp4_that_ffprobe_reads_back() {
    if !ffmpeg_tools() {
        eprintln!("skipped: no ffmpeg/ffprobe on this machine (CI installs them)");
        return;
    }
    let dir = scratch("mp4");
    let ((t, h, w), _) = reference_decode(&dir);
    let (model, latent) = wan21_fixture();
    let out = dir.join("clip.mp4");
    let (ok, text) = cli(&["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out)]);
    assert!(ok, "{text}");
    let probe = Command::new("ffprobe")
        .args(["-v", "error", "-select_streams", "v:0", "-count_frames", "-show_entries"])
        .args(["stream=codec_name,pix_fmt,width,height,r_frame_rate,nb_read_frames", "-of", "default=nw=1"])
        .arg(&out)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&probe.stdout);
    assert!(probe.status.success(), "{said}{}", String::from_utf8_lossy(&probe.stderr));
    // An odd size is padded to even for yuv420p.
    let (pw, ph) = (w.next_multiple_of(2), h.next_multiple_of(2));
    for want in [
        "codec_name=h264".to_string(),
        "pix_fmt=yuv420p".into(),
        format!("width={pw}"),
        format!("height={ph}"),
        "r_frame_rate=16/1".into(),
        format!("nb_read_frames={t}"),
    ] {
        assert!(said.lines().any(|l| l == want), "{want} in:\n{said}");
    }
}

#[test]
fn mp4_without_ffmpeg_is_a_clear_error_and_writes_nothing() {
    let dir = scratch("noffmpeg");
    let (model, latent) = wan21_fixture();
    let out = dir.join("clip.mp4");
    let (ok, text) = cli_with_env(
        &["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out), "--vae-patch-parallel-size", "2"],
        &[("VAE_FFMPEG", "/nonexistent/ffmpeg")],
    );
    assert!(!ok, "{text}");
    assert!(text.contains("MP4 output needs ffmpeg") && text.contains("VAE_FFMPEG"), "{text}");
    assert_eq!(text.lines().filter(|l| l.starts_with("error:")).count(), 1, "{text}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing written, no temporary left");
    let (ok, text) = cli(&["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out), "--fps", "0"]);
    assert!(!ok && text.contains("--fps must be at least 1"), "{text}");
}

/// `decode --stream` writes the same files as the decode that holds the whole video: `.npy`
/// byte for byte, every `.png` frame, the `.gif`, and (where ffmpeg is) the `.mp4`.
#[test]
fn streamed_outputs_are_the_same_files() {
    let dir = scratch("stream");
    let (model, latent) = wan21_fixture();
    let have_ffmpeg = Command::new("ffmpeg").arg("-version").output().is_ok_and(|o| o.status.success());
    for ext in ["npy", "png", "gif", "mp4"] {
        if ext == "mp4" && !have_ffmpeg {
            eprintln!("skipping the streamed .mp4: no ffmpeg on PATH");
            continue;
        }
        let whole = dir.join(format!("whole.{ext}"));
        let streamed = dir.join(format!("streamed.{ext}"));
        let base = ["decode", "--model", s(&model), "--latent", s(&latent), "--fps", "8"];
        let (ok, text) = cli(&[&base[..], &["--out", s(&whole)]].concat());
        assert!(ok, "{text}");
        let (ok, text) = cli(&[&base[..], &["--out", s(&streamed), "--stream"]].concat());
        assert!(ok && text.contains("streamed"), "{text}");
        let files = |stem: &str| -> Vec<PathBuf> {
            let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(stem) && s(p).ends_with(ext))
                .collect();
            found.sort();
            found
        };
        let (a, b) = (files("whole"), files("streamed"));
        assert!(!a.is_empty() && a.len() == b.len(), "{ext}: {a:?} against {b:?}");
        for (x, y) in a.iter().zip(&b) {
            assert!(
                std::fs::read(x).unwrap() == std::fs::read(y).unwrap(),
                "{} and {} differ",
                x.display(),
                y.display()
            );
        }
    }
    // Over several ranks the streamed spatial shard writes what the unstreamed one does, on
    // local ranks and on socket processes.
    let base = ["decode", "--model", s(&model), "--latent", s(&latent), "--vae-patch-parallel-size", "2"];
    let shard = ["--vae-parallel-mode", "spatial_shard_width"];
    let whole = dir.join("shard.npy");
    let (ok, text) = cli(&[&base[..], &shard, &["--ranks", "2", "--out", s(&whole)]].concat());
    assert!(ok, "{text}");
    for transport in ["local", "socket"] {
        let streamed = dir.join(format!("shard-{transport}.npy"));
        let args = [&base[..], &shard, &["--ranks", "2", "--transport", transport, "--stream", "--out", s(&streamed)]];
        let (ok, text) = cli(&args.concat());
        assert!(ok, "{transport}: {text}");
        assert!(std::fs::read(&whole).unwrap() == std::fs::read(&streamed).unwrap(), "{transport}: files differ");
    }
    // So does a 2 × 2 grid of blocks (corners exchanged) over 4 socket processes: the same
    // bytes again.
    let streamed = dir.join("blocks-socket.npy");
    let blocks = ["decode", "--model", s(&model), "--latent", s(&latent), "--vae-patch-parallel-size", "4"];
    let grid = ["--vae-parallel-mode", "spatial_shard_2d", "--shard-grid", "2x2", "--transport", "socket"];
    let (ok, text) = cli(&[&blocks[..], &grid, &["--ranks", "4", "--stream", "--out", s(&streamed)]].concat());
    assert!(ok && text.contains("shard-2x2"), "{text}");
    assert!(std::fs::read(&whole).unwrap() == std::fs::read(&streamed).unwrap(), "streamed blocks differ");
    // Tiles stream too, on 2 local ranks, with the same bytes as unstreamed.
    let (whole, streamed) = (dir.join("tiles.npy"), dir.join("tiles-streamed.npy"));
    let tiling = ["--tile-sample-min-height", "16", "--tile-sample-min-width", "24"];
    let tiling = [&tiling[..], &["--tile-sample-stride-height", "8", "--tile-sample-stride-width", "16"]].concat();
    let (ok, text) = cli(&[&base[..], &tiling, &["--ranks", "2", "--out", s(&whole)]].concat());
    assert!(ok, "{text}");
    let (ok, text) = cli(&[&base[..], &tiling, &["--ranks", "2", "--stream", "--out", s(&streamed)]].concat());
    assert!(ok && text.contains("tile(s)"), "{text}");
    assert!(std::fs::read(&whole).unwrap() == std::fs::read(&streamed).unwrap(), "streamed tiles differ");
}

/// `--vae-parallel-mode pipeline` writes the direct decode's file byte for byte: on 3 local
/// ranks, and streamed on 2 socket processes; the report names each rank's stage.
#[test]
fn pipelined_decodes_write_the_direct_decode_file() {
    let dir = scratch("pipeline");
    let (model, latent) = wan21_fixture();
    let direct = dir.join("direct.npy");
    let (ok, text) = cli(&["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&direct)]);
    assert!(ok, "{text}");
    let pipeline = ["--vae-parallel-mode", "pipeline"];
    for (name, extra) in [
        ("local", &["--vae-patch-parallel-size", "3"][..]),
        ("socket", &["--vae-patch-parallel-size", "2", "--transport", "socket", "--stream"][..]),
    ] {
        let out = dir.join(format!("{name}.npy"));
        let report = dir.join(format!("{name}.json"));
        let base = ["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out), "--report", s(&report)];
        let (ok, text) = cli(&[&base[..], &pipeline, extra].concat());
        assert!(ok && text.contains("pipeline"), "{name}: {text}");
        assert!(std::fs::read(&direct).unwrap() == std::fs::read(&out).unwrap(), "{name}: files differ");
        let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
        assert_eq!(report["strategy"], "pipeline", "{report}");
        let ranks = report["ranks"].as_array().unwrap();
        for (rank, r) in ranks.iter().enumerate() {
            assert_eq!(r["pipeline"]["stage"], rank, "{name}: {r}");
            assert_eq!(r["pipeline"]["runs"], 3, "{name}: every stage ran every latent frame: {r}");
        }
    }
    // The encoder does not pipeline: encode falls back to tiles, with the reason.
    let video = dir.join("direct.npy");
    let moments = dir.join("moments.npy");
    let args = ["encode", "--model", s(&model), "--input", s(&video), "--out", s(&moments)];
    let (ok, text) = cli(&[&args[..], &pipeline, &["--vae-patch-parallel-size", "2"]].concat());
    assert!(ok && text.contains("only the decoder runs as a pipeline"), "{text}");
}

/// A rank killed in the middle of a streamed pipeline decode (over socket processes) fails the
/// request on every rank, fast, and the owner leaves no file, final or staged.
#[test]
fn a_rank_killed_mid_pipeline_fails_the_request_and_leaves_no_file() {
    use vae_parallel::tensor::{Device, Tensor};
    let dir = scratch("pipeline-kill");
    let (model, _) = wan21_fixture();
    // Long enough to be killed mid-stream, even unoptimised: 48 latent frames of 16×16.
    let latent = dir.join("long.npy");
    let z = Tensor::seeded_uniform(vec![1, 16, 48, 16, 16], 3, -1.0, 1.0, &Device::Cpu).unwrap();
    std::fs::write(&latent, vae_parallel::io::npy_bytes(&z).unwrap()).unwrap();
    let frames = dir.join("frames");
    std::fs::create_dir_all(&frames).unwrap();
    let out = frames.join("clip.png");
    let child = Command::new(env!("CARGO_BIN_EXE_vae-parallel"))
        .args(["decode", "--model", s(&model), "--latent", s(&latent), "--out", s(&out), "--stream"])
        .args(["--vae-parallel-mode", "pipeline", "--vae-patch-parallel-size", "2", "--transport", "socket"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let supervisor = child.id();
    // Rank 1, once the owner has staged its first frames.
    let rank_one = || -> Option<String> {
        let children = std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children")).ok()?;
        children.split_whitespace().map(str::to_string).find(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            environ.split(|b| *b == 0).any(|var| var == b"VAE_RANK=1")
        })
    };
    let started = std::time::Instant::now();
    let victim = loop {
        let staged = std::fs::read_dir(&frames).unwrap().count();
        if let (true, Some(pid)) = (staged > 0, rank_one()) {
            break pid;
        }
        assert!(started.elapsed().as_secs() < 120, "the decode never started streaming");
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert!(Command::new("kill").args(["-KILL", &victim]).status().unwrap().success());
    let killed = std::time::Instant::now();
    let output = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the request succeeded without rank 1: {text}");
    assert!(killed.elapsed().as_secs() < 30, "the group took {:?} to give up", killed.elapsed());
    assert!(text.contains("rank 1"), "the failure names the lost rank: {text}");
    let left: Vec<_> = std::fs::read_dir(&frames).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "files left behind: {left:?}");
}
