//! The tile executor over the socket transport: every rank is a separate process, and the
//! result must be bit-identical to a single-rank run for every group size.

use std::sync::Arc;

use vae_integration_tests::{SCENARIO_ENV, assert_all_succeeded, spawn_ranks, unix_master, wait_all};
use vae_planner::{GridSpec, TileTask};
use vae_runtime::synthetic::SyntheticDecoder;
use vae_runtime::{
    DistributedVaeExecutor, Job, OperatorError, Output, OutputPlacement, RuntimeError, Stage, StitchLayout, TileMap,
    TileOperator, TilePlan,
};
use vae_tensor::{DType, Device, Tensor};
use vae_transport::{Communicator, SocketComm, TransportConfig, run_local};

const ENTRY: &str = "rank_process_entry";

fn input() -> Tensor {
    let dims = [1, 3, 22, 29];
    let n: usize = dims.iter().product();
    let data = (0..n).map(|i| ((i as f32) * 0.37).sin() + ((i * 7919) % 101) as f32 * 0.01).collect();
    Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
}

fn op() -> SyntheticDecoder {
    SyntheticDecoder { tile: 8, stride: 6, scale: 4, ..SyntheticDecoder::default() }
}

fn single_rank_reference() -> Tensor {
    run_local(1, TransportConfig::default(), |c| {
        DistributedVaeExecutor::new(Arc::new(c), 1).unwrap().run(
            &input(),
            Job::tiles(&op()),
            Output::Placed(OutputPlacement::OwnerOnly),
        )
    })
    .unwrap()
    .remove(0)
    .unwrap()
    .unwrap()
    .tensor
    .unwrap()
}

/// Fails tile 2 of every request.
struct FailsTileTwo(SyntheticDecoder);

impl TileOperator for FailsTileTwo {
    type Payload = <SyntheticDecoder as TileOperator>::Payload;
    type TileSpec = StitchLayout;

    fn split(&self, input: &Tensor) -> Result<TilePlan<Self::Payload, StitchLayout>, OperatorError> {
        self.0.split(input)
    }

    fn exec(&self, input: &Tensor, task: &TileTask<Self::Payload>) -> Result<Tensor, OperatorError> {
        if task.tile_id == 2 {
            return Err("tile 2 is corrupt".into());
        }
        self.0.exec(input, task)
    }

    fn merge(&self, tiles: TileMap, grid: &GridSpec<StitchLayout, DType>) -> Result<Tensor, OperatorError> {
        self.0.merge(tiles, grid)
    }

    fn stitch_layout<'g>(&self, grid: &'g GridSpec<StitchLayout, DType>) -> Option<&'g StitchLayout> {
        self.0.stitch_layout(grid)
    }

    fn device(&self) -> Device {
        Device::Cpu
    }
}

#[test]
#[ignore = "entry point of the rank processes that the tests below spawn"]
fn rank_process_entry() {
    let scenario = std::env::var(SCENARIO_ENV).expect("spawned by a test");
    let comm: Arc<dyn Communicator> = Arc::new(SocketComm::from_env().expect("join the group"));
    let rank = comm.rank();
    let executor = DistributedVaeExecutor::new(Arc::clone(&comm), comm.size()).unwrap();
    let x = input();
    match scenario.as_str() {
        "parity" => {
            let reference = single_rank_reference();
            for placement in [OutputPlacement::OwnerOnly, OutputPlacement::AllRanks] {
                let out = executor.run(&x, Job::tiles(&op()), Output::Placed(placement)).unwrap();
                match out.tensor {
                    Some(t) => {
                        assert!(rank == 0 || placement == OutputPlacement::AllRanks);
                        assert!(
                            t.bit_eq(&reference),
                            "rank {rank} {placement:?}: max diff {}",
                            t.max_abs_diff(&reference).unwrap()
                        );
                    }
                    None => assert!(rank > 0 && placement == OutputPlacement::OwnerOnly),
                }
            }
        }
        "exec_error" => {
            let err = executor
                .run(&x, Job::tiles(&FailsTileTwo(op())), Output::Placed(OutputPlacement::OwnerOnly))
                .unwrap_err();
            match &err {
                RuntimeError::Operator { stage: Stage::Exec { tile_id: 2 }, message, .. } => {
                    assert!(message.contains("corrupt"), "{err}")
                }
                other => panic!("rank {rank}: expected the exec error, got {other}"),
            }
            // The failure was agreed: the same group serves the next request.
            let out = executor.run(&x, Job::tiles(&op()), Output::Placed(OutputPlacement::AllRanks)).unwrap();
            assert!(out.tensor.unwrap().bit_eq(&single_rank_reference()));
        }
        "autoencoder_kl" => {
            // The tiled fixture cases of the AutoencoderKL family, decode and encode.
            let dir = vae_integration_tests::fixtures_dir().join("autoencoder_kl");
            for case in vae_integration_tests::fixture_cases("autoencoder_kl")
                .iter()
                .filter(|c| c.tiling && (c.op == "decode" || c.op == "encode"))
            {
                let mut model = vae_models::autoencoder_kl::AutoencoderKl::load(&dir.join(&case.model)).unwrap();
                model.set_tiling(case.tile_sample_min_size, case.tile_overlap_factor).unwrap();
                let input = vae_parallel::io::read_npy(dir.join(&case.input)).unwrap();
                let task = if case.op == "decode" {
                    vae_models::autoencoder_kl::KlTask::Decode
                } else {
                    vae_models::autoencoder_kl::KlTask::Encode
                };
                let op = vae_models::autoencoder_kl::KlOperator::new(&model, task, true);
                let out = executor
                    .run(&input, Job::tiles(&op), Output::Placed(OutputPlacement::AllRanks))
                    .unwrap()
                    .tensor
                    .unwrap();
                let serial = vae_runtime::execute_serial(&op, &input).unwrap();
                assert!(out.bit_eq(&serial), "{} on rank {rank}", case.name);
            }
        }
        "wan" => {
            // Wan2.1 tiled decode and encode over processes, as the fixtures tile them.
            let dir = vae_integration_tests::fixtures_dir().join("wan");
            let mut model = vae_models::wan::WanVae::load(&dir.join("wan21_like")).unwrap();
            model.set_tiling([16, 24], [8, 16]).unwrap();
            let z = vae_parallel::io::read_npy(dir.join("wan21_like.decode_tiled.in.npy")).unwrap();
            let op = vae_models::wan::WanDecodeOperator::new(&model, true);
            let out =
                executor.run(&z, Job::tiles(&op), Output::Placed(OutputPlacement::AllRanks)).unwrap().tensor.unwrap();
            assert!(out.bit_eq(&vae_runtime::execute_serial(&op, &z).unwrap()), "decode on rank {rank}");
            model.set_tiling([24, 32], [16, 16]).unwrap();
            let x = vae_parallel::io::read_npy(dir.join("wan21_like.encode_tiled_f5.in.npy")).unwrap();
            let op = vae_models::wan::WanEncodeOperator::new(&model, true);
            let out =
                executor.run(&x, Job::tiles(&op), Output::Placed(OutputPlacement::AllRanks)).unwrap().tensor.unwrap();
            assert!(out.bit_eq(&vae_runtime::execute_serial(&op, &x).unwrap()), "encode on rank {rank}");
        }
        "wan_shard" => {
            // Shard decode along both axes for every video family, against the direct decode.
            for (family, name, seed) in
                [("wan", "wan21_like", 1u64), ("wan", "wan22_like", 2), ("qwen_image", "qwen_image_like", 3)]
            {
                let model =
                    vae_models::wan::WanVae::load(&vae_integration_tests::fixtures_dir().join(family).join(name))
                        .unwrap();
                let z_dim = model.config().z_dim;
                let z = vae_integration_tests::random_tensor(&[1, z_dim, 2, 7, 5], seed);
                let direct = model.decode(&z).unwrap();
                let op = vae_models::wan::WanShardDecodeOperator::new(&model);
                for axis in [vae_runtime::ShardAxis::Height, vae_runtime::ShardAxis::Width] {
                    let out =
                        executor.run(&z, Job::bands(&op, axis), Output::Placed(OutputPlacement::AllRanks)).unwrap();
                    let got = out.tensor.unwrap();
                    let diff = got.max_abs_diff(&direct).unwrap();
                    assert!(diff <= 1e-5, "{name} {axis} on rank {rank}: {diff}");
                }
            }
        }
        other => panic!("unknown scenario {other}"),
    }
}

#[test]
fn bit_identical_on_one_to_eight_processes_with_and_without_broadcast() {
    for world in 1..=8 {
        let exits = wait_all(spawn_ranks(ENTRY, "parity", world, &unix_master("parity"), &[]));
        assert_all_succeeded(&format!("parity on {world} processes"), &exits);
    }
}

#[test]
fn an_exec_error_in_one_process_is_an_error_in_every_process() {
    let exits = wait_all(spawn_ranks(ENTRY, "exec_error", 4, &unix_master("execerr"), &[]));
    assert_all_succeeded("exec error on 4 processes", &exits);
}

#[test]
fn autoencoder_kl_tile_parallel_is_bit_identical_on_two_to_four_processes() {
    for world in 2..=4 {
        let exits = wait_all(spawn_ranks(ENTRY, "autoencoder_kl", world, &unix_master("akl"), &[]));
        assert_all_succeeded(&format!("AutoencoderKL on {world} processes"), &exits);
    }
}

#[test]
fn wan_tile_parallel_is_bit_identical_on_two_and_three_processes() {
    for world in [2, 3] {
        let exits = wait_all(spawn_ranks(ENTRY, "wan", world, &unix_master("wan"), &[]));
        assert_all_succeeded(&format!("Wan on {world} processes"), &exits);
    }
}

#[test]
fn wan_shard_decode_equals_the_direct_decode_on_two_to_four_processes() {
    for world in 2..=4 {
        let exits = wait_all(spawn_ranks(ENTRY, "wan_shard", world, &unix_master("wanshard"), &[]));
        assert_all_succeeded(&format!("Wan shard on {world} processes"), &exits);
    }
}
