//! The streaming decode of the causal video families (Wan2.1, Wan2.2, Qwen-Image): frames
//! handed on as they are decoded are bit for bit the direct decode's, memory does not grow with
//! the frame count, and a failure mid-stream leaves no output file behind.

use std::path::Path;

use vae_integration_tests::{fixtures_dir, random_tensor};
use vae_parallel::engine::{Engine, RequestOptions};
use vae_parallel::io::read_npy;
use vae_parallel::models::TileOverrides;
use vae_parallel::stream_out::StreamedOutput;
use vae_runtime::{CollectFrames, FrameSink, ParallelMode, SinkError};
use vae_tensor::{Tensor, memory};

fn engine(family: &str, model: &str) -> Engine {
    Engine::load(&fixtures_dir().join(family).join(model), &TileOverrides::default()).unwrap()
}

fn direct() -> RequestOptions {
    RequestOptions { mode: ParallelMode::Tile, use_tiling: false, latents_normalized: false, placement: None }
}

/// Counts the frames and keeps none of them.
#[derive(Default)]
struct Discard {
    dims: Vec<usize>,
    frames: usize,
}

impl FrameSink for Discard {
    fn begin(&mut self, dims: &[usize]) -> Result<(), SinkError> {
        self.dims = dims.to_vec();
        Ok(())
    }

    fn frames(&mut self, _: usize, chunk: &Tensor) -> Result<(), SinkError> {
        self.frames += chunk.dims()[2];
        Ok(())
    }
}

#[test]
fn streamed_frames_are_the_direct_decode_bit_for_bit() {
    for (family, model, case) in [
        ("wan", "wan21_like", "decode_t3"),
        ("wan", "wan22_like", "decode_t2"),
        ("qwen_image", "qwen_image_like", "decode_t3"),
        ("wan", "wan21_like", "decode_normalized"),
    ] {
        let e = engine(family, model);
        let z = read_npy(&fixtures_dir().join(family).join(format!("{model}.{case}.in.npy"))).unwrap();
        let mut options = direct();
        options.latents_normalized = case == "decode_normalized";
        let whole = e.model().decode(&if options.latents_normalized {
            e.model().denormalize_latents(&z).unwrap()
        } else {
            z.clone()
        });
        let whole = whole.unwrap();
        let mut collected = CollectFrames::new();
        e.decode_streaming(&z, &options, &mut collected).unwrap();
        let streamed = collected.into_tensor().unwrap();
        assert_eq!(streamed.dims(), whole.dims(), "{model} {case}");
        assert_eq!(streamed.as_bytes().unwrap(), whole.as_bytes().unwrap(), "{model} {case}: not bit-identical");
    }
}

/// The tensor high-water mark above what was alive before, of `f` run on a fresh thread.
fn peak_above_start(f: impl FnOnce() + Send + 'static) -> usize {
    std::thread::spawn(move || {
        memory::reset_peak();
        let before = memory::live_bytes();
        f();
        memory::peak_bytes() - before
    })
    .join()
    .unwrap()
}

#[test]
fn a_streamed_decode_peaks_the_same_for_few_and_many_frames() {
    let e = std::sync::Arc::new(engine("wan", "wan21_like"));
    // 2 and 16 latent frames (5 and 61 output frames) of the fixture's size.
    let peaks = |frames: usize, streamed: bool| {
        let e = std::sync::Arc::clone(&e);
        peak_above_start(move || {
            let model = e.model();
            let z = random_tensor(&[1, 16, frames, 4, 6], 7);
            if streamed {
                let mut sink = Discard::default();
                model.decode_streaming(&z, &mut sink).unwrap();
                assert_eq!((sink.frames, sink.dims[2]), (1 + 4 * (frames - 1), 1 + 4 * (frames - 1)));
            } else {
                drop(model.decode(&z).unwrap());
            }
        })
    };
    let (short, long) = (peaks(2, true), peaks(16, true));
    assert!(long as f64 <= 1.10 * short as f64, "streamed: peak {long} B for 16 latent frames, {short} B for 2");
    // The measurement sees an output that grows: the direct decode's peak does.
    let (short_whole, long_whole) = (peaks(2, false), peaks(16, false));
    assert!(long_whole as f64 > 2.0 * short_whole as f64, "direct: {long_whole} B against {short_whole} B");
}

/// Passes frames on to a [`StreamedOutput`] until `fail_at`, then fails.
struct FailAfter<'a> {
    out: &'a mut StreamedOutput,
    fail_at: usize,
}

impl FrameSink for FailAfter<'_> {
    fn begin(&mut self, dims: &[usize]) -> Result<(), SinkError> {
        self.out.begin(dims)
    }

    fn frames(&mut self, first: usize, chunk: &Tensor) -> Result<(), SinkError> {
        if first >= self.fail_at {
            return Err("the disk is full".into());
        }
        self.out.frames(first, chunk)
    }
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn a_failure_mid_stream_leaves_no_file() {
    let e = engine("wan", "wan21_like");
    let z = read_npy(&fixtures_dir().join("wan").join("wan21_like.decode_t3.in.npy")).unwrap();
    for name in ["clip.npy", "clip.png"] {
        let dir = std::env::temp_dir().join(format!("vae-stream-fail-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut out = StreamedOutput::new(&dir.join(name), 16).unwrap();
        let err = e.decode_streaming(&z, &direct(), &mut FailAfter { out: &mut out, fail_at: 5 }).unwrap_err();
        assert!(err.to_string().contains("the disk is full"), "{err}");
        // Frames 0..5 were written to staged files; dropping the output removes them.
        assert!(out.frames_written() == 5 && !files_in(&dir).is_empty());
        assert!(out.finish().is_err(), "an unfinished stream does not commit");
        assert_eq!(files_in(&dir), Vec::<String>::new(), "{name}: files left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
