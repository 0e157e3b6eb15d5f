//! The pipelined decode of the causal video families (Wan2.1, Wan2.2, Qwen-Image): the
//! decoder's layers in stages over the ranks, each latent frame handed from stage to stage.
//! Its output is the direct decode's bit for bit, streamed or not, on any number of ranks; a
//! stage's memory does not grow with the frame count; a failure fails every rank.

use std::sync::Arc;

use vae_integration_tests::{fixtures_dir, random_tensor};
use vae_models::wan::{WanPipelineDecodeOperator, WanVae};
use vae_runtime::{
    CollectFrames, DistributedVaeExecutor, FrameSink, Job, Output, OutputPlacement, RankReport, SinkError,
    StrategyReport,
};
use vae_tensor::Tensor;

fn model(family: &str, name: &str) -> WanVae {
    WanVae::load(&fixtures_dir().join(family).join(name)).unwrap()
}

const FAMILIES: [(&str, &str); 3] = [("wan", "wan21_like"), ("wan", "wan22_like"), ("qwen_image", "qwen_image_like")];

/// The pipelined decode on `world` local ranks (`parallel` of them in the pipeline): the
/// owner's output (streamed into a sink when `streamed`) and every rank's report.
fn pipelined(model: &WanVae, z: &Tensor, world: usize, parallel: usize, streamed: bool) -> (Tensor, Vec<RankReport>) {
    let results = vae_transport::run_local(world, vae_transport::TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), parallel).unwrap();
        let owner = exec.communicator().rank() == 0;
        if streamed {
            let op = WanPipelineDecodeOperator::streaming(model);
            let mut sink = owner.then(CollectFrames::new);
            let out = exec
                .run(z, Job::pipeline(&op), Output::Streamed(sink.as_mut().map(|s| s as &mut dyn FrameSink)))
                .unwrap();
            assert!(out.tensor.is_none(), "the frames went to the sink");
            (sink.map(|s| s.into_tensor().unwrap()), out.report)
        } else {
            let op = WanPipelineDecodeOperator::new(model);
            let out = exec.run(z, Job::pipeline(&op), Output::Placed(OutputPlacement::OwnerOnly)).unwrap();
            assert_eq!(out.tensor.is_some(), owner);
            (out.tensor, out.report)
        }
    })
    .unwrap();
    let mut results: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    let output = results[0].0.take().expect("the owner has the output");
    (output, results.into_iter().map(|(_, report)| report).collect())
}

fn stage_of(report: &RankReport) -> &vae_runtime::PipelineStage {
    match &report.strategy {
        StrategyReport::Pipeline(stage) => stage,
        other => panic!("not a pipeline report: {other:?}"),
    }
}

#[test]
fn a_pipelined_decode_is_the_direct_decode_bit_for_bit_on_one_to_four_ranks() {
    for (family, name) in FAMILIES {
        let model = model(family, name);
        // 4 latent frames: the pipeline fills, runs full and drains on every rank count.
        let z = random_tensor(&[1, model.config().z_dim, 4, 5, 7], 21);
        let direct = model.decode(&z).unwrap();
        for ranks in 1..=4 {
            for streamed in [false, true] {
                let (out, reports) = pipelined(&model, &z, ranks, ranks, streamed);
                assert!(out.bit_eq(&direct), "{name} on {ranks} rank(s), streamed {streamed}: not bit-identical");
                // The stages cover the decoder's steps once, in rank order, and each ran
                // every latent frame.
                let mut next = 0;
                for (rank, report) in reports.iter().enumerate() {
                    let stage = stage_of(report);
                    assert_eq!((stage.stage, stage.stages, stage.runs), (Some(rank), ranks, 4), "{name} rank {rank}");
                    assert_eq!(stage.steps.start, next, "{name}: stages in order");
                    assert!(!stage.steps.is_empty() && stage.weight_bytes > 0, "{name} rank {rank}: {stage:?}");
                    next = stage.steps.end;
                }
                assert_eq!(next, stage_of(&reports[0]).total_steps, "{name}: every step in a stage");
                let shares: f64 = reports.iter().map(|r| f64::from(stage_of(r).cost_share_ppm)).sum();
                assert!((shares - 1e6).abs() < 10.0, "{name}: cost shares sum to {shares} ppm");
            }
        }
    }
}

#[test]
fn the_fixtures_decode_as_diffusers_does_through_the_pipeline() {
    for (family, name, case) in [
        ("wan", "wan21_like", "decode_t3"),
        ("wan", "wan22_like", "decode_t2"),
        ("qwen_image", "qwen_image_like", "decode_t3"),
    ] {
        let dir = fixtures_dir().join(family);
        let model = model(family, name);
        let z = vae_parallel::io::read_npy(dir.join(format!("{name}.{case}.in.npy"))).unwrap();
        let expected = vae_parallel::io::read_npy(dir.join(format!("{name}.{case}.out.npy"))).unwrap();
        let (out, _) = pipelined(&model, &z, 3, 3, false);
        let diff = out.max_abs_diff(&expected).unwrap();
        assert!(diff <= 1e-4, "{name} {case}: max |diff| {diff} against diffusers");
    }
}

#[test]
fn ranks_beyond_the_pipeline_only_join_the_request() {
    let model = model("wan", "wan21_like");
    let z = random_tensor(&[1, 16, 3, 4, 6], 4);
    let direct = model.decode(&z).unwrap();
    let (out, reports) = pipelined(&model, &z, 4, 2, true);
    assert!(out.bit_eq(&direct));
    assert_eq!(stage_of(&reports[1]).stage, Some(1));
    for idle in &reports[2..] {
        let stage = stage_of(idle);
        assert_eq!((stage.stage, stage.runs, stage.bytes_out), (None, 0, 0), "{stage:?}");
    }
}

#[test]
fn a_one_frame_latent_and_a_batch_pipeline_too() {
    let model = model("wan", "wan21_like");
    for dims in [[1, 16, 1, 4, 6], [2, 16, 2, 4, 6]] {
        let z = random_tensor(&dims, 8);
        let direct = model.decode(&z).unwrap();
        let (out, _) = pipelined(&model, &z, 3, 3, false);
        assert!(out.bit_eq(&direct), "{dims:?}");
    }
}

#[test]
fn a_streamed_pipeline_peaks_the_same_for_few_and_many_frames() {
    let model = model("wan", "wan21_like");
    let op = WanPipelineDecodeOperator::streaming(&model);
    vae_integration_tests::assert_streamed_peaks_flat([6, 8], 5, |exec, z, sink| {
        exec.run(z, Job::pipeline(&op), Output::Streamed(sink)).unwrap().report
    });
    // Unstreamed, the owner assembles the whole output: its peak grows, so the measure sees it.
    let owner_peak = |frames: usize| {
        let z = random_tensor(&[1, 16, frames, 6, 8], 5);
        pipelined(&model, &z, 2, 2, false).1[0].peak_bytes
    };
    let (s, l) = (owner_peak(2), owner_peak(16));
    assert!(l as f64 > 1.5 * s as f64, "unstreamed owner: {l} B against {s} B");
}

/// Fails on the frames from `fail_at` on.
struct FailAt(usize);

impl FrameSink for FailAt {
    fn begin(&mut self, _: &[usize]) -> Result<(), SinkError> {
        Ok(())
    }

    fn frames(&mut self, first: usize, _: Tensor) -> Result<(), SinkError> {
        if first >= self.0 { Err("the disk is full".into()) } else { Ok(()) }
    }
}

#[test]
fn a_sink_failure_mid_pipeline_fails_every_rank() {
    let model = model("wan", "wan21_like");
    let op = WanPipelineDecodeOperator::streaming(&model);
    let z = random_tensor(&[1, 16, 4, 4, 6], 9);
    for ranks in [2, 3] {
        let results = vae_transport::run_local(ranks, vae_transport::TransportConfig::default(), |comm| {
            let exec = DistributedVaeExecutor::new(Arc::new(comm), ranks).unwrap();
            let mut sink = FailAt(5);
            let sink = (exec.communicator().rank() == 0).then_some(&mut sink as &mut dyn FrameSink);
            exec.run(&z, Job::pipeline(&op), Output::Streamed(sink)).unwrap_err().to_string()
        })
        .unwrap();
        let errors: Vec<String> = results.into_iter().map(|r| r.unwrap()).collect();
        assert!(errors[0].contains("the disk is full"), "{errors:?}");
        for e in &errors[1..] {
            assert!(e.contains("rank 0"), "every other rank learns who failed: {errors:?}");
        }
    }
}

#[test]
fn a_bad_latent_is_one_agreed_error_on_every_rank() {
    let model = model("wan", "wan21_like");
    let op = WanPipelineDecodeOperator::new(&model);
    let z = random_tensor(&[1, 8, 2, 4, 6], 1);
    let results = vae_transport::run_local(3, vae_transport::TransportConfig::default(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap();
        let err = exec.run(&z, Job::pipeline(&op), Output::Placed(OutputPlacement::OwnerOnly)).unwrap_err();
        // The group stays usable after an agreed error.
        let good = random_tensor(&[1, 16, 2, 4, 6], 1);
        exec.run(&good, Job::pipeline(&op), Output::Placed(OutputPlacement::AllRanks)).unwrap();
        (err.is_agreed(), err.to_string())
    })
    .unwrap();
    let errors: Vec<(bool, String)> = results.into_iter().map(|r| r.unwrap()).collect();
    for (agreed, text) in &errors {
        assert!(*agreed && text.contains("Wan latent must be [B, 16, T, H, W]"), "{errors:?}");
        assert_eq!(text, &errors[0].1);
    }
}

#[test]
fn processes_that_keep_only_their_stage_decode_the_same_bits() {
    for (family, name) in FAMILIES {
        let z_dim = model(family, name).config().z_dim;
        let z = random_tensor(&[1, z_dim, 3, 5, 7], 13);
        let direct = model(family, name).decode(&z).unwrap();
        // One model per rank, as one process per rank loads its own; each keeps its stage.
        let models: Vec<WanVae> = (0..3)
            .map(|rank| {
                let mut m = model(family, name);
                let before = vae_tensor::memory::live_bytes();
                let steps = m.keep_only_pipeline_stage(z.dims(), 3, rank).unwrap();
                assert!(!steps.is_empty(), "{name}: rank {rank} has a stage");
                assert!(vae_tensor::memory::live_bytes() < before, "{name}: rank {rank} let go of nothing");
                m
            })
            .collect();
        let results = vae_transport::run_local(3, vae_transport::TransportConfig::default(), |comm| {
            let rank = vae_transport::Communicator::rank(&comm);
            let exec = DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap();
            let op = WanPipelineDecodeOperator::new(&models[rank]);
            exec.run(&z, Job::pipeline(&op), Output::Placed(OutputPlacement::OwnerOnly)).unwrap().tensor
        })
        .unwrap();
        let out = results.into_iter().next().unwrap().unwrap().expect("the owner has the output");
        assert!(out.bit_eq(&direct), "{name}: not bit-identical with kept stages");

        // A kept stage runs nothing else: the whole decode, an encode, another size, another
        // cut, and keeping twice are typed errors.
        let kept = &models[1];
        let refused = |what: &str, err: vae_models::ModelError| {
            assert!(err.to_string().contains("keeps only the weights of pipeline stage 1 of 3"), "{what}: {err}");
        };
        refused("decode", kept.decode(&z).unwrap_err());
        refused("mode", kept.check_mode(vae_runtime::ParallelMode::Tile).unwrap_err());
        refused("encode", kept.encode_moments(&random_tensor(&[1, 3, 1, 16, 16], 2)).unwrap_err());
        let mut again = model(family, name);
        again.keep_only_pipeline_stage(z.dims(), 3, 0).unwrap();
        let err = again.keep_only_pipeline_stage(z.dims(), 3, 0).unwrap_err();
        assert!(err.to_string().contains("already kept one"), "{err}");
        let other_size = random_tensor(&[1, z_dim, 3, 6, 7], 13);
        let results = vae_transport::run_local(3, vae_transport::TransportConfig::default(), |comm| {
            let rank = vae_transport::Communicator::rank(&comm);
            let exec = DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap();
            let op = WanPipelineDecodeOperator::new(&models[rank]);
            exec.run(&other_size, Job::pipeline(&op), Output::Placed(OutputPlacement::OwnerOnly))
                .unwrap_err()
                .to_string()
        })
        .unwrap();
        for err in results.into_iter().map(|r| r.unwrap()) {
            assert!(err.contains("for 5x7 latents, not 6x7 ones"), "{name}: {err}");
        }
    }
}
