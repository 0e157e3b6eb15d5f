//! The tile executor on the local (threads) backend: bit-identical output for 1..8 ranks,
//! against an independent serial replay of the diffusers loop, and every failure path.

use std::sync::Arc;
use std::time::Duration;

use vae_planner::{GridSpec, TileTask};
use vae_runtime::synthetic::SyntheticDecoder;
use vae_runtime::{
    Classified, DistributedVaeExecutor, FailureKind, Job, OperatorError, Output, OutputPlacement, RuntimeError, Stage,
    StitchLayout, TileMap, TileMerge, TileOperator, TilePlan,
};
use vae_tensor::{DType, Device, Tensor};
use vae_transport::{Communicator, TransportConfig, TransportError, run_local};

fn config() -> TransportConfig {
    TransportConfig { collective_timeout: Duration::from_secs(30), ..TransportConfig::default() }
}

/// Deterministic pseudo-random input.
fn input(dims: &[usize], seed: u32) -> Tensor {
    let n: usize = dims.iter().product();
    let mut state = seed.wrapping_mul(2654435761).wrapping_add(1);
    let data = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, dims, &Device::Cpu).unwrap()
}

/// diffusers' Wan `tiled_decode` loop, replayed serially and independently of the executor
/// and of `stitch`: decode every tile, blend_v then blend_h in place in row-major order, keep
/// `[:stride, :stride]`, concatenate, crop.
fn serial_reference(op: &SyntheticDecoder, x: &Tensor) -> Tensor {
    let r = x.rank();
    let (h, w) = (x.dims()[r - 2], x.dims()[r - 1]);
    let s = op.scale;
    let blend = (op.tile - op.stride) * s;
    let keep = op.stride * s;
    let mut rows: Vec<Vec<Tensor>> = Vec::new();
    let mut id = 0;
    for i in (0..h).step_by(op.stride) {
        let mut row = Vec::new();
        for j in (0..w).step_by(op.stride) {
            row.push(op.tile_output(x, i..(i + op.tile).min(h), j..(j + op.tile).min(w), id).unwrap());
            id += 1;
        }
        rows.push(row);
    }
    let blend_along = |a: &Tensor, b: &Tensor, dim: usize| -> Tensor {
        let e = blend.min(a.dims()[dim]).min(b.dims()[dim]);
        let mut out = b.to_vec_f32().unwrap();
        let (av, dims_a, dims_b) = (a.to_vec_f32().unwrap(), a.dims().to_vec(), b.dims().to_vec());
        let stride_of = |dims: &[usize], d: usize| dims[d + 1..].iter().product::<usize>();
        for (idx, v) in out.iter_mut().enumerate() {
            let y = (idx / stride_of(&dims_b, dim)) % dims_b[dim];
            if y < e {
                let shift = (dims_a[dim] - e + y) as isize - y as isize;
                let outer = idx / (stride_of(&dims_b, dim) * dims_b[dim]);
                let inner = idx % stride_of(&dims_b, dim);
                let a_idx = (outer * dims_a[dim] + (y as isize + shift) as usize) * stride_of(&dims_a, dim) + inner;
                let t = y as f64 / e as f64;
                *v = (av[a_idx] * (1.0 - t) as f32) + (*v * t as f32);
            }
        }
        Tensor::from_vec(out, dims_b, &Device::Cpu).unwrap()
    };
    for i in 0..rows.len() {
        for j in 0..rows[i].len() {
            if i > 0 {
                rows[i][j] = blend_along(&rows[i - 1][j], &rows[i][j], r - 2);
            }
            if j > 0 {
                rows[i][j] = blend_along(&rows[i][j - 1], &rows[i][j], r - 1);
            }
        }
    }
    let result_rows: Vec<Tensor> = rows
        .iter()
        .map(|row| {
            let kept: Vec<Tensor> = row
                .iter()
                .map(|t| {
                    let t = t.narrow(r - 2, 0, keep.min(t.dims()[r - 2])).unwrap();
                    t.narrow(r - 1, 0, keep.min(t.dims()[r - 1])).unwrap()
                })
                .collect();
            Tensor::cat(&kept.iter().collect::<Vec<_>>(), r - 1).unwrap()
        })
        .collect();
    let full = Tensor::cat(&result_rows.iter().collect::<Vec<_>>(), r - 2).unwrap();
    full.narrow(r - 2, 0, h * s).unwrap().narrow(r - 1, 0, w * s).unwrap()
}

fn run<O: TileOperator + Sync>(
    world: usize,
    parallel: usize,
    op: &O,
    x: &Tensor,
    placement: OutputPlacement,
) -> Vec<Result<vae_runtime::ExecOutput, RuntimeError>> {
    run_merged(TileMerge::Owner, world, parallel, op, x, placement)
}

/// [`run`] with stitched tiles merged as `merge` says.
fn run_merged<O: TileOperator + Sync>(
    merge: TileMerge,
    world: usize,
    parallel: usize,
    op: &O,
    x: &Tensor,
    placement: OutputPlacement,
) -> Vec<Result<vae_runtime::ExecOutput, RuntimeError>> {
    run_local(world, config(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), parallel).unwrap().with_tile_merge(merge);
        exec.run(x, Job::tiles(op), Output::Placed(placement))
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("no rank panics"))
    .collect()
}

fn small_op() -> SyntheticDecoder {
    SyntheticDecoder { tile: 8, stride: 6, scale: 4, ..SyntheticDecoder::default() }
}

#[test]
fn one_rank_equals_the_serial_diffusers_loop() {
    let op = small_op();
    for dims in [[1, 3, 17, 23], [2, 2, 8, 8], [1, 1, 5, 31], [1, 4, 13, 6], [1, 1, 1, 1]] {
        let x = input(&dims, 7);
        let out = run(1, 1, &op, &x, OutputPlacement::OwnerOnly).remove(0).unwrap().tensor.unwrap();
        let reference = serial_reference(&op, &x);
        assert!(out.bit_eq(&reference), "{dims:?}: max diff {}", out.max_abs_diff(&reference).unwrap());
    }
}

#[test]
fn bit_identical_for_one_to_eight_ranks_with_and_without_broadcast() {
    let op = small_op();
    let x = input(&[1, 3, 20, 27], 11); // 4×5 tiles, unequal edge tiles
    let reference = serial_reference(&op, &x);
    for (world, merge) in (1..=8).flat_map(|w| [(w, TileMerge::Owner), (w, TileMerge::Edges)]) {
        for placement in [OutputPlacement::OwnerOnly, OutputPlacement::AllRanks] {
            let results = run_merged(merge, world, world, &op, &x, placement);
            let mut executed = Vec::new();
            for (rank, result) in results.into_iter().enumerate() {
                let out = result.unwrap_or_else(|e| panic!("world {world} rank {rank}: {e}"));
                executed.extend(out.report.tiles.iter().copied());
                match (&out.tensor, placement, rank) {
                    (Some(t), _, 0) | (Some(t), OutputPlacement::AllRanks, _) => {
                        assert!(t.bit_eq(&reference), "world {world} rank {rank} {placement:?}")
                    }
                    (None, OutputPlacement::OwnerOnly, r) if r > 0 => {}
                    other => panic!("world {world} rank {rank}: unexpected placement {:?}", other.0.is_some()),
                }
            }
            executed.sort_unstable();
            assert_eq!(executed, (0..20).collect::<Vec<_>>(), "every tile exactly once on {world} ranks");
        }
    }
}

/// Overlaps wider than half a tile: a tile's blended edges read edges that its neighbours
/// blended in turn, so blends chain across the grid; the tile-by-tile stitch on the owner
/// still replays them exactly, whichever rank computed which tile.
#[test]
fn overlaps_wider_than_half_a_tile_stitch_exactly_on_any_rank_count() {
    for (tile, stride) in [(8, 3), (8, 1), (6, 2), (5, 4)] {
        let op = SyntheticDecoder { tile, stride, scale: 2, ..SyntheticDecoder::default() };
        let x = input(&[1, 2, 13, 11], 5);
        let reference = serial_reference(&op, &x);
        for world in 1..=5 {
            let out = run(world, world, &op, &x, OutputPlacement::OwnerOnly).remove(0).unwrap().tensor.unwrap();
            assert!(out.bit_eq(&reference), "tile {tile} stride {stride} on {world} ranks");
        }
    }
}

#[test]
fn tiles_without_overlap_reassemble_the_doubled_input_exactly() {
    let op = SyntheticDecoder { tile: 5, stride: 5, scale: 3, tile_offset: 0.0, ..SyntheticDecoder::default() };
    let x = input(&[1, 2, 12, 9], 3);
    let expected = x.upsample_nearest2d(3).unwrap().affine(2.0, 0.0).unwrap();
    for world in [1, 3, 4] {
        let out = run(world, world, &op, &x, OutputPlacement::OwnerOnly).remove(0).unwrap().tensor.unwrap();
        assert!(out.bit_eq(&expected), "world {world}");
    }
}

#[test]
fn ranks_beyond_the_parallel_size_idle_but_take_part() {
    let op = small_op();
    let x = input(&[1, 1, 20, 20], 5);
    let reference = serial_reference(&op, &x);
    let results = run(5, 2, &op, &x, OutputPlacement::AllRanks);
    for (rank, r) in results.into_iter().enumerate() {
        let out = r.unwrap();
        assert_eq!(out.report.parallel_size, 2);
        assert_eq!(out.report.tiles.is_empty(), rank >= 2, "rank {rank}");
        assert!(out.tensor.unwrap().bit_eq(&reference));
    }
}

#[test]
fn fewer_tiles_than_ranks_leaves_ranks_idle() {
    let op = small_op();
    let x = input(&[1, 1, 8, 12], 5); // 1×2 tiles on 6 ranks
    let reference = serial_reference(&op, &x);
    let results = run(6, 6, &op, &x, OutputPlacement::AllRanks);
    for r in results {
        assert!(r.unwrap().tensor.unwrap().bit_eq(&reference));
    }
}

#[test]
fn a_parallel_size_larger_than_the_group_is_clamped() {
    let sizes =
        run_local(3, config(), |comm| DistributedVaeExecutor::new(Arc::new(comm), 8).unwrap().parallel_size()).unwrap();
    assert!(sizes.into_iter().all(|s| s.unwrap() == 3));
    let zero = run_local(1, config(), |comm| DistributedVaeExecutor::new(Arc::new(comm), 0).map(|_| ())).unwrap();
    assert!(matches!(zero[0].as_ref().unwrap(), Err(RuntimeError::Config(_))));
}

/// A merge that gathers every tile deals them by LPT, heaviest first.
#[test]
fn lpt_puts_the_big_tiles_first() {
    // Not a stitch: every tile is gathered, then merged once.
    let op = Failing::new(small_op());
    // Rows and columns start at 0, 6, 12: extents 8, 8, 2, so areas
    // [64, 64, 16, 64, 64, 16, 16, 16, 4] in tile order.
    let x = input(&[1, 1, 14, 14], 1);
    let results = run(2, 2, &op, &x, OutputPlacement::OwnerOnly);
    let reports: Vec<_> = results.into_iter().map(|r| r.unwrap().report).collect();
    assert_eq!(reports[0].tiles, vec![0, 3, 2, 6, 8]);
    assert_eq!(reports[1].tiles, vec![1, 4, 5, 7]);
    assert_eq!((reports[0].workload, reports[1].workload), (164, 160));
}

/// A stitch merged by edges runs its tiles in rounds where each tile's upper and left
/// neighbours are computed in its round or before, tiles of like size together (the four full
/// tiles first, then the ragged ones), each given to the least loaded rank; each rank sends the
/// owner only its tiles' kept parts, which together are the output: nothing overlaps.
#[test]
fn a_stitch_merged_by_edges_runs_like_tiles_together_and_gathers_only_the_output() {
    let op = small_op();
    let x = input(&[1, 1, 14, 14], 1);
    let reference = serial_reference(&op, &x);
    let results = run_merged(TileMerge::Edges, 2, 2, &op, &x, OutputPlacement::OwnerOnly);
    let outs: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    // Rounds [0, 1], [3, 4], [2, 5], [6, 7], [8].
    assert_eq!(outs[0].report.tiles, vec![0, 3, 2, 6, 8]);
    assert_eq!(outs[1].report.tiles, vec![1, 4, 5, 7]);
    assert_eq!((outs[0].report.workload, outs[1].report.workload), (164, 160));
    assert!(outs[0].tensor.as_ref().unwrap().bit_eq(&reference));
    // Rank 1's kept parts, in latent pixels: tiles 1 and 4 keep 6 × 6, tile 5 keeps 6 × 2 and
    // tile 7 2 × 6 (16 output pixels per latent pixel, 4 bytes each); the rest of the gathers
    // is the per-round summaries. Whole tiles would be 8 × 8, 8 × 8, 8 × 2 and 2 × 8.
    let kept = (6 * 6 + 6 * 6 + 6 * 2 + 2 * 6) * 16 * 4;
    let sent = outs[1].report.traffic.gather.bytes_sent as usize;
    assert!(sent >= kept && sent < kept + 1024, "rank 1 gathered {sent} bytes, its kept parts are {kept}");
    assert!(outs[1].report.traffic.bytes_received() > 0, "the edges of rank 0's tiles reach rank 1");
}

/// Where a blend ramp reaches past half a tile, a tile's blended edge depends on a chain of
/// earlier tiles, so a merge by edges gives way to whole tiles stitched on the owner in
/// diffusers' order: the same bits either way.
#[test]
fn an_overlap_past_half_a_tile_is_stitched_whole_on_the_owner() {
    let op = SyntheticDecoder { tile: 8, stride: 3, scale: 2, ..SyntheticDecoder::default() };
    let x = input(&[1, 2, 17, 13], 3);
    let reference = serial_reference(&op, &x);
    for ranks in [2, 3] {
        let results = run_merged(TileMerge::Edges, ranks, ranks, &op, &x, OutputPlacement::OwnerOnly);
        let outs: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
        assert!(outs[0].tensor.as_ref().unwrap().bit_eq(&reference), "{ranks} ranks");
        // Whole tiles, overlapping by more than half, reach the owner: the other ranks alone
        // send more than the whole output's bytes.
        let sent: u64 = outs[1..].iter().map(|o| o.report.traffic.gather.bytes_sent).sum();
        let output_bytes = (17 * 2 * 13 * 2 * 2 * 4) as u64;
        assert!(sent > output_bytes, "{sent} bytes sent, the output has {output_bytes}");
    }
}

/// Wraps an operator and makes one stage fail, by error or by panic.
struct Failing {
    inner: SyntheticDecoder,
    fail_split: bool,
    fail_exec_tile: Option<usize>,
    panic: bool,
    fail_merge: bool,
    /// The kind its errors are classified as; `None` returns them as they are.
    kind: Option<FailureKind>,
    /// Whether it says its merge is a stitch (tiles merged on the owner as they come), or not
    /// (every tile gathered, then one merge).
    stitched: bool,
}

impl Failing {
    /// `inner`, failing nowhere.
    fn new(inner: SyntheticDecoder) -> Self {
        Self {
            inner,
            fail_split: false,
            fail_exec_tile: None,
            panic: false,
            fail_merge: false,
            kind: None,
            stitched: false,
        }
    }

    fn error(&self, message: String) -> OperatorError {
        match self.kind {
            Some(kind) => Box::new(Classified::new(kind, message)),
            None => message.into(),
        }
    }
}

impl TileOperator for Failing {
    type Payload = <SyntheticDecoder as TileOperator>::Payload;
    type TileSpec = StitchLayout;

    fn split(&self, input: &Tensor) -> Result<TilePlan<Self::Payload, StitchLayout>, OperatorError> {
        if self.fail_split {
            return Err(self.error(format!("an input of shape {} does not fit", input.shape())));
        }
        self.inner.split(input)
    }

    fn exec(&self, input: &Tensor, task: &TileTask<Self::Payload>) -> Result<Tensor, OperatorError> {
        if Some(task.tile_id) == self.fail_exec_tile {
            if self.panic {
                panic!("tile {} exploded", task.tile_id);
            }
            return Err(self.error(format!("tile {} is corrupt", task.tile_id)));
        }
        self.inner.exec(input, task)
    }

    fn merge(&self, tiles: TileMap, grid: &GridSpec<StitchLayout, DType>) -> Result<Tensor, OperatorError> {
        if self.fail_merge {
            return Err(self.error("merge refused".into()));
        }
        self.inner.merge(tiles, grid)
    }

    fn stitch_layout<'g>(&self, grid: &'g GridSpec<StitchLayout, DType>) -> Option<&'g StitchLayout> {
        self.stitched.then_some(&grid.tile_spec)
    }

    fn finish_stitched(&self, stitched: Tensor, _: &GridSpec<StitchLayout, DType>) -> Result<Tensor, OperatorError> {
        if self.fail_merge {
            return Err(self.error("merge refused".into()));
        }
        Ok(stitched)
    }

    fn device(&self) -> Device {
        Device::Cpu
    }
}

#[test]
fn an_exec_error_on_one_rank_is_an_error_on_every_rank_and_the_group_survives() {
    let cases = [(false, false), (true, false), (false, true), (true, true)]
        .into_iter()
        .flat_map(|c| [(c, TileMerge::Owner), (c, TileMerge::Edges)]);
    for ((panic, stitched), merge) in cases {
        let failing = Failing { fail_exec_tile: Some(3), panic, stitched, ..Failing::new(small_op()) };
        let x = input(&[1, 1, 14, 20], 2);
        let results = run_local(4, config(), |comm| {
            let exec = DistributedVaeExecutor::new(Arc::new(comm), 4).unwrap().with_tile_merge(merge);
            let first = exec.run(&x, Job::tiles(&failing), Output::Placed(OutputPlacement::OwnerOnly));
            // Agreed errors leave the communicator usable for the next request.
            let second = exec.run(&x, Job::tiles(&small_op()), Output::Placed(OutputPlacement::AllRanks));
            (first, second)
        })
        .unwrap();
        let reference = serial_reference(&small_op(), &x);
        let mut failing_rank = None;
        for r in results {
            let (first, second) = r.unwrap();
            match first.unwrap_err() {
                RuntimeError::Operator {
                    stage: Stage::Exec { tile_id: 3 },
                    rank,
                    kind: FailureKind::Failed,
                    message,
                } => {
                    assert!(message.contains(if panic { "exploded" } else { "corrupt" }), "{message}");
                    assert_eq!(*failing_rank.get_or_insert(rank), rank, "every rank names the same rank");
                }
                other => panic!("unexpected error {other}"),
            }
            assert!(second.unwrap().tensor.unwrap().bit_eq(&reference));
        }
    }
}

#[test]
fn a_merge_error_on_the_owner_reaches_every_rank() {
    let x = input(&[1, 1, 10, 10], 2);
    for (stitched, merge) in [(false, TileMerge::Owner), (true, TileMerge::Owner), (true, TileMerge::Edges)] {
        let failing = Failing { fail_merge: true, stitched, ..Failing::new(small_op()) };
        for placement in [OutputPlacement::OwnerOnly, OutputPlacement::AllRanks] {
            for r in run_merged(merge, 3, 3, &failing, &x, placement) {
                let err = r.unwrap_err();
                assert!(matches!(&err, RuntimeError::Operator { stage: Stage::Merge, rank: 0, .. }), "{err}");
            }
        }
    }
}

#[test]
fn a_bad_input_is_a_split_error_on_every_rank() {
    let x = input(&[7], 1);
    for r in run(3, 3, &small_op(), &x, OutputPlacement::OwnerOnly) {
        let err = r.unwrap_err();
        assert!(matches!(&err, RuntimeError::Operator { stage: Stage::Split, rank: 0, .. }), "{err}");
        assert!(err.to_string().contains("at least 2 dimensions"), "{err}");
        assert_eq!(err.failure_kind(), Some(FailureKind::Failed), "an error that says nothing more");
    }
}

/// A classified error of any stage, on any rank, reaches every rank with its kind, and with
/// the message the same error has unclassified (the kind is not in the text).
#[test]
fn a_classified_error_reaches_every_rank_with_its_kind_and_its_message() {
    let x = input(&[1, 1, 14, 20], 2);
    let stages: [fn(Option<FailureKind>) -> Failing; 5] = [
        |kind| Failing { fail_split: true, kind, ..Failing::new(small_op()) },
        |kind| Failing { fail_exec_tile: Some(3), kind, ..Failing::new(small_op()) },
        |kind| Failing { fail_exec_tile: Some(3), kind, stitched: true, ..Failing::new(small_op()) },
        |kind| Failing { fail_merge: true, kind, ..Failing::new(small_op()) },
        |kind| Failing { fail_merge: true, kind, stitched: true, ..Failing::new(small_op()) },
    ];
    for (failing, merge) in stages.into_iter().flat_map(|f| [(f, TileMerge::Owner), (f, TileMerge::Edges)]) {
        let plain: Vec<RuntimeError> = run_merged(merge, 4, 4, &failing(None), &x, OutputPlacement::AllRanks)
            .into_iter()
            .map(|r| r.unwrap_err())
            .collect();
        for kind in [FailureKind::InvalidInput, FailureKind::Unsupported, FailureKind::Failed] {
            let classified = run_merged(merge, 4, 4, &failing(Some(kind)), &x, OutputPlacement::AllRanks);
            for (rank, (got, plain)) in classified.into_iter().zip(&plain).enumerate() {
                let got = got.unwrap_err();
                assert!(matches!(got, RuntimeError::Operator { kind: k, .. } if k == kind), "rank {rank}: {got:?}");
                assert_eq!(got.to_string(), plain.to_string(), "rank {rank}");
                assert_eq!(plain.failure_kind(), Some(FailureKind::Failed), "rank {rank}: {plain}");
            }
        }
    }
}

/// A classified error keeps the wrapped error's text and causes: what the CLI prints with
/// its causes is the same with or without the kind.
#[test]
fn a_classified_error_reads_as_the_error_it_wraps() {
    #[derive(Debug, thiserror::Error)]
    #[error("the latent does not fit")]
    struct Outer(#[source] std::io::Error);
    let wrapped = Classified::new(FailureKind::InvalidInput, Outer(std::io::Error::other("4 channels, 16 expected")));
    assert_eq!(wrapped.kind(), FailureKind::InvalidInput);
    assert_eq!(wrapped.to_string(), "the latent does not fit");
    let source = std::error::Error::source(&wrapped).map(ToString::to_string);
    assert_eq!(source.as_deref(), Some("4 channels, 16 expected"));
    assert_eq!(FailureKind::default(), FailureKind::Failed);
}

#[test]
fn different_inputs_on_different_ranks_are_refused_everywhere() {
    let a = input(&[1, 1, 10, 10], 1);
    let b = input(&[1, 1, 10, 10], 2);
    let results = run_local(3, config(), |comm| {
        let x = if comm.rank() == 1 { &b } else { &a };
        DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap().run(
            x,
            Job::tiles(&small_op()),
            Output::Placed(OutputPlacement::OwnerOnly),
        )
    })
    .unwrap();
    for r in results {
        match r.unwrap() {
            Err(RuntimeError::InputMismatch { hashes }) => {
                assert_eq!(hashes[0], hashes[2]);
                assert_ne!(hashes[0], hashes[1]);
            }
            other => panic!("expected an input mismatch, got {other:?}"),
        }
    }
}

#[test]
fn a_rank_that_dies_mid_request_fails_the_others_naming_it() {
    let x = input(&[1, 1, 20, 20], 4);
    let results = run_local(3, config(), |comm| {
        if comm.rank() == 2 {
            // Dies before joining the request (its communicator is dropped while panicking).
            let _comm = comm;
            panic!("rank 2 lost its device");
        }
        DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap().run(
            &x,
            Job::tiles(&small_op()),
            Output::Placed(OutputPlacement::OwnerOnly),
        )
    })
    .unwrap();
    assert!(results[2].is_err());
    for r in &results[..2] {
        match r.as_ref().unwrap() {
            Err(RuntimeError::Transport(e)) => {
                assert_eq!(e.failed_rank(), Some(2), "{e}");
                assert!(matches!(e.root_cause(), TransportError::PeerFailed { .. }), "{e}");
            }
            other => panic!("expected a transport error, got {other:?}"),
        }
    }
}

/// Tiles stitched as they are computed: a rank other than the owner holds one tile output at a
/// time, so the most it holds does not grow with the image (16 tiles or 169), and the owner holds
/// the output plus a working set of a few tiles and one row of blend edges. Merged by edges, a
/// rank also holds the edges of its next tiles, its share of a row and a column of them: growing
/// with the image's sides, not its area. The whole-map merge, which keeps every tile until one
/// gather, is the contrast that shows the accounting sees them.
#[test]
fn stitched_tiles_keep_a_non_owner_ranks_memory_flat_in_the_image_size() {
    let op = small_op();
    let held = |x: &Tensor, stitched: bool, merge: TileMerge| -> Vec<(usize, usize)> {
        let failing = Failing { stitched, ..Failing::new(op.clone()) };
        run_merged(merge, 2, 2, &failing, x, OutputPlacement::OwnerOnly)
            .into_iter()
            .map(|r| r.unwrap().report)
            .map(|r| (r.peak_bytes - r.start_bytes, r.tiles.len()))
            .collect()
    };
    let (small, large) = (input(&[1, 1, 20, 20], 4), input(&[1, 1, 80, 80], 4));
    let tile_bytes = (op.tile * op.scale).pow(2) * 4;
    let output_bytes = (80 * op.scale).pow(2) * 4;
    let blend = (op.tile - op.stride) * op.scale;
    // The last `blend` rows of a row of tiles (80 latent pixels wide, 14 tiles).
    let edge_row_bytes = (80 * op.scale + 14 * blend) * blend * 4;
    let (s, l) = (held(&small, true, TileMerge::Owner), held(&large, true, TileMerge::Owner));
    assert!(l[1].1 > 4 * s[1].1, "the large image has many more tiles: {s:?} {l:?}");
    let (small_peak, large_peak) = (s[1].0 as f64, l[1].0 as f64);
    assert!(
        (0.9 * small_peak..=1.1 * small_peak).contains(&large_peak),
        "a non-owner rank's peak is one tile's work, whatever the image: {s:?} {l:?}"
    );
    assert!(
        l[0].0 <= output_bytes + 8 * tile_bytes + edge_row_bytes,
        "owner holds {} bytes: output {output_bytes}, tile {tile_bytes}, edge row {edge_row_bytes}",
        l[0].0
    );
    let (s, l) = (held(&small, true, TileMerge::Edges), held(&large, true, TileMerge::Edges));
    assert!(
        l[1].0 <= s[1].0 + 2 * edge_row_bytes,
        "by edges, a non-owner rank's peak is one tile's work and at most a row and a column of edges: {s:?} {l:?}"
    );
    assert!(l[0].0 <= output_bytes + 8 * tile_bytes + 2 * edge_row_bytes, "owner: {l:?}");
    let (s, l) = (held(&small, false, TileMerge::Owner), held(&large, false, TileMerge::Owner));
    assert!(l[1].0 > 4 * s[1].0, "the whole-map merge holds every tile until the gather: {s:?} {l:?}");
}

#[test]
fn the_report_accounts_for_the_request() {
    let op = small_op();
    let x = input(&[1, 1, 20, 20], 4);
    let results = run(3, 3, &op, &x, OutputPlacement::AllRanks);
    for r in results {
        let report = r.unwrap().report;
        assert_eq!(report.tile_count, 16);
        assert_eq!(report.world_size, 3);
        // Agreement (gather, broadcast), results (a gather per round of tiles: 16 tiles on 3
        // ranks make 6), outcome (broadcast).
        assert_eq!(report.traffic.all_gather.calls, 0);
        assert_eq!(report.traffic.gather.calls, 1 + 6);
        assert_eq!(report.traffic.broadcast.calls, 2);
        if report.rank > 0 {
            assert!(report.traffic.gather.bytes_sent > 0);
        }
    }
}

/// What a rank other than the owner receives for one request does not grow with the group (it
/// hears the owner's two verdicts and nothing else), and the owner hears each rank once per
/// gather: the coordination is linear in the group's size, not quadratic.
#[test]
fn a_request_costs_each_rank_the_same_traffic_whatever_the_group_size() {
    let op = small_op();
    let x = input(&[1, 1, 20, 20], 4);
    let reference = serial_reference(&op, &x);
    let mut received_by_others = Vec::new();
    for world in [2, 8, 64] {
        let (mut owner_gathered, mut others_sent) = (0, 0);
        for r in run(world, world, &op, &x, OutputPlacement::OwnerOnly) {
            let out = r.unwrap();
            let traffic = out.report.traffic;
            assert_eq!(traffic.all_gather.calls, 0, "world {world}");
            if out.report.rank == 0 {
                assert!(out.tensor.unwrap().bit_eq(&reference), "world {world}");
                owner_gathered = traffic.gather.bytes_received;
            } else {
                received_by_others.push((world, traffic.bytes_received()));
                others_sent += traffic.gather.bytes_sent;
            }
        }
        // The owner hears what each other rank gathered to it, once, and nothing more.
        assert!(
            owner_gathered > 0 && owner_gathered == others_sent,
            "world {world}: {owner_gathered} vs {others_sent}"
        );
    }
    let first = received_by_others[0].1;
    assert!(first > 0);
    assert!(received_by_others.iter().all(|(_, b)| *b == first), "{received_by_others:?}");
}

/// A group at the size limit runs a request to the same output as one rank (and in about a
/// second: every rank's part in the coordination is O(1), the owner's O(N)).
#[test]
fn a_group_of_the_largest_size_runs_a_request() {
    let op = small_op();
    let x = input(&[1, 1, 20, 20], 9);
    let reference = serial_reference(&op, &x);
    let world = vae_transport::MAX_WORLD_SIZE;
    let results = run(world, world, &op, &x, OutputPlacement::OwnerOnly);
    assert_eq!(results.len(), world);
    let mut tiles = 0;
    for (rank, r) in results.into_iter().enumerate() {
        let out = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        tiles += out.report.tiles.len();
        if rank == 0 {
            assert!(out.tensor.unwrap().bit_eq(&reference));
        }
    }
    assert_eq!(tiles, 16);
}

#[test]
fn each_rank_reports_its_own_tiles_to_its_own_progress_sink() {
    use vae_runtime::execute_serial;
    use vae_runtime::progress::{Progress, collect};

    let op = small_op();
    let x = input(&[1, 1, 20, 20], 4); // 16 tiles
    let seen: Vec<Vec<Progress>> = run_local(3, config(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap();
        collect(|| exec.run(&x, Job::tiles(&op), Output::Placed(OutputPlacement::OwnerOnly)).unwrap()).1
    })
    .unwrap()
    .into_iter()
    .map(|r| r.expect("no rank panics"))
    .collect();
    // Each rank counts 0..=its share, one update per tile; the shares add up to the plan.
    let mut tiles = 0;
    for (rank, updates) in seen.iter().enumerate() {
        let total = updates.len() - 1;
        let expected: Vec<Progress> = (0..=total).map(|done| Progress::Tiles { done, total }).collect();
        assert_eq!(updates, &expected, "rank {rank}");
        tiles += total;
    }
    assert_eq!(tiles, 16);

    // The serial path reports every tile of the plan.
    let (_, serial) = collect(|| execute_serial(&op, &x).unwrap());
    assert_eq!(serial.last(), Some(&Progress::Tiles { done: 16, total: 16 }));
    assert_eq!(serial.len(), 17);
}

/// Splits differently on its first call than on later ones: a non-deterministic operator.
struct FirstSplitDiffers {
    calls: std::sync::atomic::AtomicUsize,
}

impl TileOperator for FirstSplitDiffers {
    type Payload = <SyntheticDecoder as TileOperator>::Payload;
    type TileSpec = StitchLayout;

    fn split(&self, input: &Tensor) -> Result<TilePlan<Self::Payload, StitchLayout>, OperatorError> {
        let first = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        let tile = if first { 10 } else { 8 };
        SyntheticDecoder { tile, stride: tile - 2, scale: 2, ..SyntheticDecoder::default() }.split(input)
    }

    fn exec(&self, input: &Tensor, task: &TileTask<Self::Payload>) -> Result<Tensor, OperatorError> {
        small_op().exec(input, task)
    }

    fn merge(&self, tiles: TileMap, grid: &GridSpec<StitchLayout, DType>) -> Result<Tensor, OperatorError> {
        small_op().merge(tiles, grid)
    }

    fn device(&self) -> Device {
        Device::Cpu
    }
}

#[test]
fn a_non_deterministic_split_is_the_same_error_everywhere_and_the_group_survives() {
    let op = FirstSplitDiffers { calls: Default::default() };
    let x = input(&[1, 1, 30, 30], 9);
    let results = run_local(3, config(), |comm| {
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap();
        let first = exec.run(&x, Job::tiles(&op), Output::Placed(OutputPlacement::OwnerOnly));
        let second = exec.run(&x, Job::tiles(&small_op()), Output::Placed(OutputPlacement::OwnerOnly));
        (first, second.map(|_| ()))
    })
    .unwrap();
    for r in results {
        let (first, second) = r.unwrap();
        let err = first.unwrap_err();
        assert!(matches!(&err, RuntimeError::Inconsistent(m) if m.contains("not deterministic")), "{err}");
        second.unwrap();
    }
}

/// Counts the tiles each rank executes and, on one rank, announces a failure of the group as
/// that rank's first tile runs (as a rank whose process died would be seen).
struct Dying {
    inner: SyntheticDecoder,
    comm: Vec<Arc<dyn Communicator>>,
    executed: Vec<std::sync::atomic::AtomicUsize>,
}

impl TileOperator for Dying {
    type Payload = <SyntheticDecoder as TileOperator>::Payload;
    type TileSpec = StitchLayout;

    fn split(&self, input: &Tensor) -> Result<TilePlan<Self::Payload, StitchLayout>, OperatorError> {
        self.inner.split(input)
    }

    fn exec(&self, input: &Tensor, task: &TileTask<Self::Payload>) -> Result<Tensor, OperatorError> {
        let rank = RANK.with(|r| r.get());
        self.executed[rank].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if rank == 1 {
            self.comm[1].abort("rank 1 lost its GPU");
            std::thread::sleep(Duration::from_secs(1));
        }
        self.inner.exec(input, task)
    }

    fn merge(&self, tiles: TileMap, grid: &GridSpec<StitchLayout, DType>) -> Result<Tensor, OperatorError> {
        self.inner.merge(tiles, grid)
    }

    fn device(&self) -> Device {
        Device::Cpu
    }
}

thread_local! {
    static RANK: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Once the group has failed, a rank stops between tiles: it does not compute the rest of its
/// share first and only then learn it at the gather.
#[test]
fn a_rank_stops_between_tiles_once_its_group_failed() {
    let x = input(&[1, 1, 62, 62], 9);
    // 100 ms per tile, 100 tiles: rank 0's half would take 5 s.
    let inner = SyntheticDecoder { work_per_tile: Duration::from_millis(100), ..small_op() };
    let comms: Vec<vae_transport::LocalComm> = vae_transport::local_group(2, config()).unwrap();
    let comms: Vec<Arc<dyn Communicator>> = comms.into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator>).collect();
    let dying = Dying { inner, comm: comms.clone(), executed: (0..2).map(|_| Default::default()).collect() };
    let errors: Vec<RuntimeError> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (comm, dying, x) = (Arc::clone(comm), &dying, &x);
                s.spawn(move || {
                    RANK.with(|r| r.set(rank));
                    let exec = DistributedVaeExecutor::new(comm, 2).unwrap();
                    exec.run(x, Job::tiles(dying), Output::Placed(OutputPlacement::OwnerOnly)).unwrap_err()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let rank0 = dying.executed[0].load(std::sync::atomic::Ordering::SeqCst);
    assert!(rank0 <= 3, "rank 0 executed {rank0} tiles after the group failed");
    assert!(errors[0].to_string().contains("rank 1 lost its GPU"), "{}", errors[0]);
}

/// Ranks given different tile merges would run different collectives: the agreement refuses
/// the request on every rank (no hang).
#[test]
fn ranks_that_disagree_on_the_tile_merge_are_refused_everywhere() {
    let x = input(&[1, 1, 14, 20], 2);
    let reference = serial_reference(&small_op(), &x);
    let results = run_local(3, config(), |comm| {
        let merge = if comm.rank() == 2 { TileMerge::Edges } else { TileMerge::Owner };
        let exec = DistributedVaeExecutor::new(Arc::new(comm), 3).unwrap().with_tile_merge(merge);
        exec.run(&x, Job::tiles(&small_op()), Output::Placed(OutputPlacement::OwnerOnly))
    })
    .unwrap();
    for r in results {
        match r.unwrap() {
            Err(RuntimeError::Inconsistent(message)) => {
                assert!(message.contains("rank 2") && message.contains("edges"), "{message}")
            }
            other => panic!("expected a disagreement, got {other:?}"),
        }
    }
    // Ranks beyond the parallel size join every collective of a merge by edges.
    let results = run_merged(TileMerge::Edges, 4, 2, &small_op(), &x, OutputPlacement::AllRanks);
    for (rank, r) in results.into_iter().enumerate() {
        let out = r.unwrap();
        assert!(out.tensor.unwrap().bit_eq(&reference), "rank {rank}");
        assert_eq!(out.report.tiles.is_empty(), rank >= 2, "rank {rank}");
    }
}
