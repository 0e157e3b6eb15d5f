//! The streaming decode of the causal video families (Wan2.1, Wan2.2, Qwen-Image): frames
//! handed on as they are decoded are bit for bit the direct decode's, memory does not grow with
//! the frame count, and a failure mid-stream leaves no output file behind.

use std::path::Path;

use vae_integration_tests::{fixtures_dir, random_tensor};
use vae_parallel::io::read_npy;
use vae_parallel::stream_out::StreamedOutput;
use vae_parallel::{Decode, Vae};
use vae_runtime::{CollectFrames, FrameSink, Job, Output, SinkError};
use vae_tensor::{Tensor, memory};

fn engine(family: &str, model: &str) -> Vae {
    vae_integration_tests::load_vae(&fixtures_dir().join(family).join(model))
}

/// `f` with an executor over a group of one local rank.
fn on_one_rank<R: Send>(f: impl Fn(&vae_runtime::DistributedVaeExecutor) -> R + Sync) -> R {
    let mut results = vae_transport::run_local(1, vae_transport::TransportConfig::default(), |comm| {
        f(&vae_runtime::DistributedVaeExecutor::new(std::sync::Arc::new(comm), 1).unwrap())
    })
    .unwrap();
    results.remove(0).unwrap()
}

fn direct() -> Decode {
    vae_integration_tests::reference(vae_runtime::ParallelMode::Tile)
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

    fn frames(&mut self, _: usize, chunk: Tensor) -> Result<(), SinkError> {
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
        let z = read_npy(fixtures_dir().join(family).join(format!("{model}.{case}.in.npy"))).unwrap();
        let mut options = direct();
        options.latents_normalized = case == "decode_normalized";
        let whole = e.model().decode(&if options.latents_normalized {
            e.model().denormalize_latents(&z).unwrap()
        } else {
            z.clone()
        });
        let whole = whole.unwrap();
        let streamed = on_one_rank(|exec| {
            let mut collected = CollectFrames::new();
            assert!(e.decode_streaming_on(exec, &z, &options, Some(&mut collected)).unwrap().is_none());
            collected.into_tensor().unwrap()
        });
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
    assert!(long_whole as f64 > 1.5 * short_whole as f64, "direct: {long_whole} B against {short_whole} B");
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

    fn frames(&mut self, first: usize, chunk: Tensor) -> Result<(), SinkError> {
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
    let z = read_npy(fixtures_dir().join("wan").join("wan21_like.decode_t3.in.npy")).unwrap();
    for name in ["clip.npy", "clip.png"] {
        let dir = std::env::temp_dir().join(format!("vae-stream-fail-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join(name);
        on_one_rank(|exec| {
            let mut out = StreamedOutput::new(&target, 16).unwrap();
            let mut failing = FailAfter { out: &mut out, fail_at: 5 };
            let err = e.decode_streaming_on(exec, &z, &direct(), Some(&mut failing)).unwrap_err();
            assert!(err.to_string().contains("the disk is full"), "{err}");
            // Frames 0..5 were written to staged files; dropping the output removes them.
            assert!(out.frames_written() == 5 && !files_in(target.parent().unwrap()).is_empty());
            assert!(out.finish().is_err(), "an unfinished stream does not commit");
        });
        assert_eq!(files_in(&dir), Vec::<String>::new(), "{name}: files left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The streamed spatial shard on `world` local ranks (`parallel` of them computing): the
/// owner's frames, collected, and every rank's report.
fn streamed_shard(
    model: &vae_models::wan::WanVae,
    z: &Tensor,
    axis: vae_runtime::ShardAxis,
    world: usize,
    parallel: usize,
) -> (Tensor, Vec<vae_runtime::RankReport>) {
    use std::sync::Arc;
    use vae_models::wan::WanShardDecodeOperator;
    use vae_runtime::DistributedVaeExecutor;
    let op = WanShardDecodeOperator::streaming(model);
    let results = vae_transport::run_local(world, vae_transport::TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), parallel).unwrap();
        let mut sink = (exec.communicator().rank() == 0).then(CollectFrames::new);
        let out = exec
            .run(z, Job::bands(&op, axis), Output::Streamed(sink.as_mut().map(|s| s as &mut dyn FrameSink)))
            .unwrap();
        assert!(out.tensor.is_none(), "the frames went to the sink");
        (sink.map(|s| s.into_tensor().unwrap()), out.report)
    })
    .unwrap();
    let mut results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    let frames = results[0].0.take().expect("the owner collected the frames");
    (frames, results.into_iter().map(|(_, report)| report).collect())
}

#[test]
fn a_streamed_shard_is_the_shard_decode_bit_for_bit() {
    use vae_runtime::ShardAxis;
    for (family, name) in [("wan", "wan21_like"), ("wan", "wan22_like"), ("qwen_image", "qwen_image_like")] {
        let model = vae_models::wan::WanVae::load(&fixtures_dir().join(family).join(name)).unwrap();
        let z = random_tensor(&[1, model.config().z_dim, 3, 7, 10], 11);
        for axis in [ShardAxis::Height, ShardAxis::Width] {
            // 2 and 3 computing ranks, and 3 ranks of which one only joins the gathers.
            for (world, parallel) in [(2, 2), (3, 3), (3, 2)] {
                let (whole, _) = vae_integration_tests::shard_on_local_ranks(
                    &vae_models::wan::WanShardDecodeOperator::new(&model),
                    &z,
                    axis,
                    parallel,
                );
                let (streamed, reports) = streamed_shard(&model, &z, axis, world, parallel);
                assert!(streamed.bit_eq(&whole), "{name} {axis} on {parallel} of {world} ranks: not bit-identical");
                assert!(reports.iter().take(parallel).all(|r| r.timings.gather > std::time::Duration::ZERO));
            }
        }
    }
}

/// The streamed 2-D shard: blocks of 1 × 2, 2 × 2 and 2 × 3 grids (and a 2 × 2 grid on 5 ranks,
/// the fifth joining only the gathers), each run's blocks put in their places on the owner:
/// the block decode, bit for bit, and each computing rank's report says its block.
#[test]
fn a_streamed_block_decode_is_the_block_decode_bit_for_bit() {
    use std::sync::Arc;
    use vae_models::wan::WanShardDecodeOperator;
    use vae_runtime::{DistributedVaeExecutor, StrategyReport};
    for (family, name) in [("wan", "wan21_like"), ("wan", "wan22_like")] {
        let model = vae_models::wan::WanVae::load(&fixtures_dir().join(family).join(name)).unwrap();
        let z = random_tensor(&[1, model.config().z_dim, 3, 7, 10], 12);
        for (grid, world) in [([1, 2], 2), ([2, 2], 4), ([2, 3], 6), ([2, 2], 5)] {
            let parallel = grid[0] * grid[1];
            let (whole, _) =
                vae_integration_tests::blocks_on_local_ranks(&WanShardDecodeOperator::new(&model), &z, grid, parallel);
            let op = WanShardDecodeOperator::streaming(&model);
            let results = vae_transport::run_local(world, vae_transport::TransportConfig::default(), |comm| {
                let exec = DistributedVaeExecutor::new(Arc::new(comm), parallel).unwrap();
                let mut sink = (exec.communicator().rank() == 0).then(CollectFrames::new);
                let out = exec
                    .run(&z, Job::blocks(&op, grid), Output::Streamed(sink.as_mut().map(|s| s as &mut dyn FrameSink)))
                    .unwrap();
                assert!(out.tensor.is_none(), "the frames went to the sink");
                (sink.map(|s| s.into_tensor().unwrap()), out.report)
            })
            .unwrap();
            let mut results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
            let streamed = results[0].0.take().expect("the owner collected the frames");
            assert!(streamed.bit_eq(&whole), "{name} on {grid:?} over {world} ranks: not bit-identical");
            for (rank, (_, report)) in results.iter().enumerate() {
                let StrategyReport::Blocks { grid: g, block, traffic } = &report.strategy else {
                    panic!("rank {rank}: not blocks")
                };
                assert_eq!(*g, grid);
                assert_eq!(block.is_some(), rank < parallel, "rank {rank}");
                assert_eq!(traffic.halo_exchanges > 0, rank < parallel, "rank {rank}: {traffic:?}");
            }
        }
    }
}

#[test]
fn a_streamed_shard_peaks_the_same_for_few_and_many_frames() {
    let model = vae_models::wan::WanVae::load(&fixtures_dir().join("wan").join("wan21_like")).unwrap();
    let op = vae_models::wan::WanShardDecodeOperator::streaming(&model);
    vae_integration_tests::assert_streamed_peaks_flat([6, 8], 5, |exec, z, sink| {
        exec.run(z, Job::bands(&op, vae_runtime::ShardAxis::Height), Output::Streamed(sink)).unwrap().report
    });
    // The same on a 2 × 1 grid of blocks (the helper's group has 2 ranks).
    vae_integration_tests::assert_streamed_peaks_flat([6, 8], 5, |exec, z, sink| {
        exec.run(z, Job::blocks(&op, [2, 1]), Output::Streamed(sink)).unwrap().report
    });
    // Unstreamed, the owner's peak grows with the frames it assembles: the measurement sees it.
    let owner_peak = |frames: usize| {
        let z = random_tensor(&[1, 16, frames, 6, 8], 5);
        vae_integration_tests::shard_on_local_ranks(&op, &z, vae_runtime::ShardAxis::Height, 2).1[0].peak_bytes
    };
    let (s, l) = (owner_peak(2), owner_peak(16));
    assert!(l as f64 > 1.5 * s as f64, "unstreamed owner: {l} B against {s} B");
}

#[test]
fn a_sink_failure_in_a_streamed_shard_fails_every_rank_and_leaves_no_file() {
    let model = vae_models::wan::WanVae::load(&fixtures_dir().join("wan").join("wan21_like")).unwrap();
    let op = vae_models::wan::WanShardDecodeOperator::streaming(&model);
    let z = random_tensor(&[1, 16, 4, 6, 8], 9);
    let dir = std::env::temp_dir().join(format!("vae-stream-shard-fail-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let target = dir.join("clip.npy");
    let results = vae_transport::run_local(2, vae_transport::TransportConfig::default(), |comm| {
        let exec = vae_runtime::DistributedVaeExecutor::new(std::sync::Arc::new(comm), 2).unwrap();
        let mut out = (exec.communicator().rank() == 0).then(|| StreamedOutput::new(&target, 16).unwrap());
        let mut failing = out.as_mut().map(|out| FailAfter { out, fail_at: 5 });
        let sink = failing.as_mut().map(|f| f as &mut dyn FrameSink);
        let err = exec.run(&z, Job::bands(&op, vae_runtime::ShardAxis::Height), Output::Streamed(sink)).unwrap_err();
        err.to_string()
    })
    .unwrap();
    let errors: Vec<String> = results.into_iter().map(|r| r.unwrap()).collect();
    assert!(errors[0].contains("the disk is full"), "{errors:?}");
    assert!(errors[1].contains("rank 0"), "the other rank learns who failed: {errors:?}");
    assert_eq!(files_in(&dir), Vec::<String>::new(), "files left behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The streamed tile decode on `world` local ranks: the owner's frames, collected.
fn streamed_tiles(model: &vae_models::wan::WanVae, z: &Tensor, world: usize) -> Tensor {
    use std::sync::Arc;
    use vae_models::wan::WanDecodeOperator;
    use vae_runtime::DistributedVaeExecutor;
    let op = WanDecodeOperator::streaming(model, true);
    let results = vae_transport::run_local(world, vae_transport::TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), world).unwrap();
        let mut sink = (exec.communicator().rank() == 0).then(CollectFrames::new);
        let out =
            exec.run(z, Job::tiles(&op), Output::Streamed(sink.as_mut().map(|s| s as &mut dyn FrameSink))).unwrap();
        assert!(out.tensor.is_none() && out.report.tile_count > 1, "tiles, streamed to the sink");
        sink.map(|s| s.into_tensor().unwrap())
    })
    .unwrap();
    results.into_iter().next().unwrap().unwrap().expect("the owner collected the frames")
}

#[test]
fn a_streamed_tile_decode_is_the_tile_decode_bit_for_bit_on_one_to_four_ranks() {
    // The fixtures' tilings (diffusers' enable_tiling keywords).
    for (family, name, min, stride) in [
        ("wan", "wan21_like", [16, 24], [8, 16]),
        ("wan", "wan22_like", [32, 48], [16, 32]),
        ("qwen_image", "qwen_image_like", [16, 24], [8, 16]),
    ] {
        let dir = fixtures_dir().join(family);
        let mut model = vae_models::wan::WanVae::load(&dir.join(name)).unwrap();
        model.set_tiling(min, stride).unwrap();
        let z = read_npy(dir.join(format!("{name}.decode_tiled.in.npy"))).unwrap();
        let whole = vae_runtime::execute_serial(&vae_models::wan::WanDecodeOperator::new(&model, true), &z).unwrap();
        for world in 1..=4 {
            let streamed = streamed_tiles(&model, &z, world);
            assert!(streamed.bit_eq(&whole), "{name} on {world} ranks: not bit-identical");
        }
        // The diffusers fixture itself, within its bound.
        let expected = read_npy(dir.join(format!("{name}.decode_tiled.out.npy"))).unwrap();
        assert!(whole.max_abs_diff(&expected).unwrap() <= 1e-4, "{name}");
    }
}

#[test]
fn a_streamed_tile_decode_peaks_the_same_for_few_and_many_frames() {
    let mut model = vae_models::wan::WanVae::load(&fixtures_dir().join("wan").join("wan21_like")).unwrap();
    model.set_tiling([16, 24], [8, 16]).unwrap();
    let op = vae_models::wan::WanDecodeOperator::streaming(&model, true);
    vae_integration_tests::assert_streamed_peaks_flat([4, 6], 3, |exec, z, sink| {
        let out = exec.run(z, Job::tiles(&op), Output::Streamed(sink)).unwrap();
        assert!(out.report.tile_count > 2);
        out.report
    });
}
