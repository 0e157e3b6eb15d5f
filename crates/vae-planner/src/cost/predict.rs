//! Predicted latency and per-rank peak memory of one request under one strategy.
//!
//! Every strategy runs a [`Network`]'s steps on parts of the maps: the whole map (direct),
//! a band of latent rows or columns, a block of a grid, or one tile at a time. Per step and
//! part the model counts
//!
//! * compute: a convolution's multiply-adds at the profile's rate for its shape, an
//!   attention's at the attention rate, and the bytes a norm or element-wise pass reads and
//!   writes at the element-wise rate, each sped up by the threads the rank really gets;
//! * traffic: one message per halo exchange (the rows, columns and corners of the neighbours),
//!   two latencies per sharded GroupNorm (its statistics), the whole map per sharded attention
//!   (every rank gathers it), and the outputs gathered to the owner;
//! * memory: what is alive at once while the step runs, as the layers keep it: its input (on
//!   a part, its copy with the neighbours' rows), its output, the maps the family marks
//!   resident (a residual block's input), and a convolution's packed weights and scratch.
//!
//! Ranks wait for each other at every exchange, so a sharded request takes, step by step, its
//! slowest rank's time. Memory is the request's own (above what was alive when it started: the
//! weights and the input), per rank; the busiest rank's is the prediction.

use std::collections::BTreeMap;
use std::ops::Range;

use super::kernels::cpu_conv_scratch_bytes;
use super::network::{Network, Step, StepKind};
use super::profile::{DeviceKind, DeviceProfile};
use crate::overlap::pieces_where_pays;
use crate::{BandPartition, BlockGrid, PlanError, ShardAxis, lpt_assign};

/// Score elements the CPU attention holds per block of queries, and its bounds on the rows.
const SCORE_BLOCK_ELEMS: f64 = (1u64 << 22) as f64;
const SCORE_MIN_ROWS: f64 = 32.0;
const SCORE_MAX_ROWS: f64 = 1024.0;

/// How one request's work is laid over the ranks.
#[derive(Debug, Clone, Copy)]
pub enum Layout<'a> {
    /// One rank, the whole map at once.
    Direct,
    /// `ranks` bands of latent rows (or columns), exchanging halos.
    Bands {
        /// The cut axis.
        axis: ShardAxis,
        /// Ranks (bands).
        ranks: usize,
    },
    /// An `[R, C]` grid of blocks, exchanging halos with up to eight neighbours.
    Blocks {
        /// Rows and columns of blocks.
        grid: [usize; 2],
    },
    /// Tiles computed whole, dealt over `ranks` by LPT, gathered to the owner.
    Tiles {
        /// Each tile's pass, in the plan's order.
        tiles: &'a [Network],
        /// Ranks.
        ranks: usize,
        /// Whether the owner stitches tiles as they arrive (memory: one round of tiles) rather
        /// than gathering every tile first.
        stitched: bool,
    },
}

/// Where the ranks run: threads per rank, and how many ranks share one host's cores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placement {
    /// Compute threads each rank's pool holds (a fraction where ranks take turns on one
    /// thread; the host's cores are shared among the busy ranks either way).
    pub threads_per_rank: f64,
    /// Ranks on one host (sharing its cores).
    pub ranks_per_host: usize,
    /// Threads one rank uses while the others of its host are idle: its own pool's (more where
    /// ranks share a pool).
    pub threads_alone: f64,
}

/// One rank's predicted share.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankPrediction {
    /// Seconds computing.
    pub compute_s: f64,
    /// The seconds computing by kind of step ([`StepKind::label`]; the owner's blend of tiles
    /// as `blend`): where the predicted time goes.
    pub compute_by_kind: BTreeMap<String, f64>,
    /// Seconds in messages (halos, statistics, gathers).
    pub comm_s: f64,
    /// Peak bytes the request itself holds on the rank.
    pub peak_bytes: u64,
    /// Bytes it receives.
    pub received_bytes: u64,
}

/// A strategy's predicted figures.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// End-to-end latency, milliseconds.
    pub ms: f64,
    /// The busiest rank's peak bytes (above what was alive when the request started).
    pub peak_bytes: u64,
    /// Every rank's share.
    pub ranks: Vec<RankPrediction>,
}

/// A part of the latent and the sides on which it has neighbours.
#[derive(Debug, Clone)]
struct Part {
    rows: Range<usize>,
    cols: Range<usize>,
    /// Neighbours above, below, left, right.
    sides: [bool; 4],
    /// Diagonal neighbours.
    corners: usize,
}

/// One step's cost on one part.
#[derive(Debug, Clone, Copy, Default)]
struct StepCost {
    compute_s: f64,
    comm_s: f64,
    live_bytes: f64,
    received_bytes: f64,
}

/// Predicts `network` under `layout` on `profile`'s device.
///
/// # Errors
///
/// A layout that cannot cut the network's latent (more bands than rows, a grid larger than
/// the latent, zero ranks), as [`BandPartition::new`], [`BlockGrid::new`] and [`lpt_assign`]
/// refuse it.
pub fn predict(
    network: &Network,
    layout: Layout<'_>,
    placement: Placement,
    profile: &DeviceProfile,
) -> Result<Prediction, PlanError> {
    match layout {
        Layout::Direct => {
            let whole = Part { rows: 0..network.latent[0], cols: 0..network.latent[1], sides: [false; 4], corners: 0 };
            Ok(sharded(network, &[whole], 1, placement, profile))
        }
        Layout::Bands { axis, ranks } => {
            let d = usize::from(axis == ShardAxis::Width);
            let bands = BandPartition::new(network.latent[d], ranks, 1)?;
            let parts: Vec<Part> = bands
                .bands()
                .iter()
                .enumerate()
                .map(|(r, band)| {
                    let (before, after) = (r > 0, r + 1 < ranks);
                    match axis {
                        ShardAxis::Height => Part {
                            rows: band.clone(),
                            cols: 0..network.latent[1],
                            sides: [before, after, false, false],
                            corners: 0,
                        },
                        ShardAxis::Width => Part {
                            rows: 0..network.latent[0],
                            cols: band.clone(),
                            sides: [false, false, before, after],
                            corners: 0,
                        },
                    }
                })
                .collect();
            Ok(sharded(network, &parts, placement.ranks_per_host.min(parts.len()), placement, profile))
        }
        Layout::Blocks { grid } => {
            let blocks = BlockGrid::new(network.latent, grid, [1, 1])?;
            let parts: Vec<Part> = (0..blocks.ranks())
                .map(|r| {
                    let [i, j] = blocks.coord(r).unwrap_or([0, 0]);
                    let [rows, cols] = blocks.block(r).unwrap_or([0..0, 0..0]);
                    let sides = [i > 0, i + 1 < grid[0], j > 0, j + 1 < grid[1]];
                    let corners =
                        [(sides[0], sides[2]), (sides[0], sides[3]), (sides[1], sides[2]), (sides[1], sides[3])]
                            .iter()
                            .filter(|(a, b)| *a && *b)
                            .count();
                    Part { rows, cols, sides, corners }
                })
                .collect();
            Ok(sharded(network, &parts, placement.ranks_per_host.min(parts.len()), placement, profile))
        }
        Layout::Tiles { tiles, ranks, stitched } => tiled(network, tiles, ranks, stitched, placement, profile),
    }
}

/// A sharded pass (one part per rank; a single part is the direct pass) with `concurrent`
/// ranks computing at once on one host, then the gather of the output parts to rank 0.
fn sharded(
    network: &Network,
    parts: &[Part],
    concurrent: usize,
    placement: Placement,
    profile: &DeviceProfile,
) -> Prediction {
    let ranks = parts.len();
    let cpu = profile.kind == DeviceKind::Cpu;
    let speed = Speed::of(profile, placement.threads_per_rank, concurrent);
    let threads = placement.threads_per_rank.ceil().max(1.0) as usize;
    let mut per_rank = vec![RankPrediction::default(); ranks];
    let mut peaks = vec![0f64; ranks];
    let mut elapsed = 0.0;
    for step in &network.steps {
        let kind = step.kind.label(cpu);
        let mut slowest: f64 = 0.0;
        for (r, part) in parts.iter().enumerate() {
            let cost = step_cost(step, part, network, ranks > 1, (speed.for_step(step), threads), profile);
            per_rank[r].compute_s += cost.compute_s;
            match per_rank[r].compute_by_kind.get_mut(&kind) {
                Some(s) => *s += cost.compute_s,
                None => {
                    per_rank[r].compute_by_kind.insert(kind.clone(), cost.compute_s);
                }
            }
            per_rank[r].comm_s += cost.comm_s;
            per_rank[r].received_bytes += cost.received_bytes as u64;
            peaks[r] = peaks[r].max(cost.live_bytes);
            slowest = slowest.max(cost.compute_s + cost.comm_s);
        }
        elapsed += slowest;
    }
    // The owner gathers every other part's output, then holds the whole output besides them.
    let output = network.output_bytes() as f64;
    if ranks > 1 {
        let own = fraction(network, &parts[0]) * output;
        let gather = profile.message_s(output - own);
        per_rank[0].comm_s += gather;
        per_rank[0].received_bytes += (output - own) as u64;
        peaks[0] = peaks[0].max(2.0 * output);
        elapsed += gather;
    }
    for (r, part) in parts.iter().enumerate() {
        peaks[r] = peaks[r].max(fraction(network, part) * output);
        per_rank[r].peak_bytes = peaks[r] as u64;
    }
    finish(elapsed, per_rank)
}

/// The tile strategy: each rank runs its tiles whole (LPT by their work), one after another;
/// the owner receives the others' tiles and blends them into the output.
fn tiled(
    network: &Network,
    tiles: &[Network],
    ranks: usize,
    stitched: bool,
    placement: Placement,
    profile: &DeviceProfile,
) -> Result<Prediction, PlanError> {
    // Each tile's time where `concurrent` ranks of `threads` each compute at once, and its
    // memory (which the speed does not change).
    let time = |tile: &Network, threads: f64, concurrent: usize| {
        let whole = Part { rows: 0..tile.latent[0], cols: 0..tile.latent[1], sides: [false; 4], corners: 0 };
        let at = Placement { threads_per_rank: threads, ranks_per_host: concurrent, threads_alone: threads };
        sharded(tile, &[whole], concurrent, at, profile)
    };
    let workloads: Vec<u64> = tiles.iter().map(Network::macs).collect();
    let assignment = lpt_assign(&workloads, ranks)?;
    let output = network.output_bytes() as f64;
    // The ranks of one host that compute tiles at once share its cores while all are busy; a
    // rank left alone with its last tiles gets what it can use alone.
    let busy = assignment.per_rank.iter().filter(|t| !t.is_empty()).count().max(1);
    let concurrent = placement.ranks_per_host.min(busy).max(1);
    // Where the ranks share one pool, the busy ones share all of it.
    let threads = placement.threads_per_rank.max(placement.threads_alone / concurrent as f64);
    let threads_alone = placement.threads_alone.max(placement.threads_per_rank);
    let shared: Vec<Prediction> = tiles.iter().map(|t| time(t, threads, concurrent)).collect();
    let alone: Vec<f64> = tiles.iter().map(|t| time(t, threads_alone, 1).ranks[0].compute_s).collect();
    let mut per_rank = vec![RankPrediction::default(); ranks];
    let (mut total_shared, mut longest_alone): (f64, f64) = (0.0, 0.0);
    for (r, mine) in assignment.per_rank.iter().enumerate() {
        let rank = &mut per_rank[r];
        let mut held = 0.0;
        let mut peak: f64 = 0.0;
        let mut work_alone = 0.0;
        for &t in mine {
            rank.compute_s += shared[t].ranks[0].compute_s;
            for (kind, s) in &shared[t].ranks[0].compute_by_kind {
                *rank.compute_by_kind.entry(kind.clone()).or_default() += s;
            }
            work_alone += alone[t];
            let out = tiles[t].output_bytes() as f64;
            // A stitched rank sends each tile as it finishes; otherwise it keeps them all.
            peak = peak.max(held + shared[t].peak_bytes as f64);
            if !stitched {
                held += out;
            }
        }
        rank.peak_bytes = peak as u64;
        total_shared += rank.compute_s;
        longest_alone = longest_alone.max(work_alone);
    }
    // Hosts work through the tiles together (at most `concurrent` ranks at once), and no faster
    // than the rank with the most work alone.
    let hosts = ranks.div_ceil(placement.ranks_per_host.max(1)).max(1) as f64;
    let slowest = (total_shared / (concurrent as f64 * hosts)).max(longest_alone);
    // The owner receives every other rank's tiles and blends each into the output.
    let mut received = 0.0;
    let mut messages = 0usize;
    for mine in assignment.per_rank.iter().skip(1) {
        for &t in mine {
            received += tiles[t].output_bytes() as f64;
        }
        messages += usize::from(!mine.is_empty()) * if stitched { mine.len() } else { 1 };
    }
    let speed = profile.speedup(threads_alone, 1);
    let all_tiles: f64 = tiles.iter().map(|t| t.output_bytes() as f64).sum();
    let blend_s = profile.elementwise_s(2.0 * all_tiles) / speed;
    let gather_s = messages as f64 * profile.link_latency_us * 1e-6 + received / (profile.link_gbps * 1e9);
    let owner = &mut per_rank[0];
    owner.comm_s += gather_s;
    owner.compute_s += blend_s;
    *owner.compute_by_kind.entry("blend".into()).or_default() += blend_s;
    owner.received_bytes += received as u64;
    let largest_tile = tiles.iter().map(|t| t.output_bytes() as f64).fold(0.0, f64::max);
    let owner_extra = if stitched {
        // The output and this round's tiles (one per rank that has any).
        output + ranks.min(tiles.len()) as f64 * largest_tile
    } else {
        // The output and every tile.
        output + all_tiles
    };
    // The owner computes its tiles while it holds what it has stitched and received; gathering
    // every tile happens after its own are done.
    owner.peak_bytes = if stitched {
        owner.peak_bytes + (owner_extra + largest_tile) as u64
    } else {
        owner.peak_bytes.max((owner_extra + largest_tile) as u64)
    };
    let elapsed = slowest + gather_s + blend_s;
    Ok(finish(elapsed, per_rank))
}

/// How much faster than one thread alone a rank runs each kind of step.
#[derive(Debug, Clone, Copy)]
struct Speed {
    /// 2-D convolutions, norms, element-wise passes, attention.
    flat: f64,
    /// 3-D convolutions (the video VAEs'), which scale over threads differently.
    video: f64,
}

impl Speed {
    fn of(profile: &DeviceProfile, threads: f64, ranks: usize) -> Self {
        Self { flat: profile.speedup(threads, ranks), video: profile.speedup_video(threads, ranks) }
    }

    fn for_step(self, step: &Step) -> f64 {
        match step.kind {
            StepKind::Conv { kernel, .. } if kernel[0] > 1 => self.video,
            _ => self.flat,
        }
    }
}

fn finish(elapsed_s: f64, ranks: Vec<RankPrediction>) -> Prediction {
    let peak_bytes = ranks.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
    Prediction { ms: elapsed_s * 1e3, peak_bytes, ranks }
}

/// The share of every map a part holds.
fn fraction(network: &Network, part: &Part) -> f64 {
    let [h, w] = network.latent;
    (part.rows.len() as f64 / h.max(1) as f64) * (part.cols.len() as f64 / w.max(1) as f64)
}

/// One step on one part: compute, traffic and the bytes alive while it runs. `speed`: how many
/// times one thread's rate the rank computes at, on `threads` threads.
fn step_cost(
    step: &Step,
    part: &Part,
    network: &Network,
    shared: bool,
    (speed, threads): (f64, usize),
    profile: &DeviceProfile,
) -> StepCost {
    let [lh, lw] = network.latent;
    let fh = part.rows.len() as f64 / lh.max(1) as f64;
    let fw = part.cols.len() as f64 / lw.max(1) as f64;
    let batch = network.batch as f64;
    let bytes = network.elem_bytes as f64 * batch;
    let call_s = profile.op_call_us * 1e-6;
    let local = |d: [usize; 3], channels: usize| channels as f64 * d[0] as f64 * d[1] as f64 * fh * d[2] as f64 * fw;
    let input = local(step.input, step.in_channels);
    let output = local(step.output, step.out_channels);
    // The resident maps' share, with the neighbours' rows and columns that a part's caches
    // hold besides.
    let [up, down, left, right] = part.sides.map(f64::from);
    let [row, column] = step.resident_edges.map(|e| e as f64);
    let resident = step.resident as f64 * fh * fw + (up + down) * row * fw + (left + right) * column * fh;
    let whole_input = step.input_elems() as f64;
    match step.kind {
        StepKind::Conv { kernel, align, overlapped, pads } => {
            let [hh, hw] = step.halo().map(|h| h as f64);
            let [t, h, w] = [step.input[0] as f64, step.input[1] as f64 * fh, step.input[2] as f64 * fw];
            let c = step.in_channels as f64;
            let halo = c * t * ((up + down) * hh * w + (left + right) * hw * h + part.corners as f64 * hh * hw) * bytes;
            // A part's convolution reads a copy of its input with the neighbours' rows (the
            // layers drop the input itself where they own it); the kernels pad as they read.
            // A layer that pads its own input copies it with every side padded (the halo where
            // there is a neighbour) and the frames in front.
            let with_halo = if pads {
                c * (t + kernel[0].saturating_sub(1) as f64) * (h + 2.0 * hh) * (w + 2.0 * hw)
            } else {
                c * t * (h + (up + down) * hh) * (w + (left + right) * hw)
            };
            let measured = profile.conv_rate(kernel, align, step.in_channels, step.out_channels);
            let exchanges = part.sides.iter().any(|&s| s) && halo > 0.0;
            // Overlapped as the runtime decides it (a part with an interior, where
            // vae_planner::overlap says it pays), in pieces: the interior and a strip per side
            // with a neighbour, each a call.
            let positions = (step.input[0] as f64 * h * w * batch) as usize;
            let sides = [[part.sides[0], part.sides[1]], [part.sides[2], part.sides[3]]];
            let halos = [hh, hw].map(|x| x as usize);
            let pieces = pieces_where_pays([h.round() as usize, w.round() as usize], halos, sides, align, positions)
                .filter(|_| overlapped && profile.overlaps_halos());
            let overlaps = pieces.is_some();
            // Each call's outputs with every temporal tap (the measured times' positions): a CPU
            // kernel skips the taps on a causal convolution's zero padding, a GPU's computes
            // them. One call on one thread: what it pays whatever its size, and the rest. The
            // direct kernel packs the weights once for all the pieces; Winograd transforms them
            // for each.
            let gpu = profile.kind == DeviceKind::Cuda;
            let taps_done = if gpu { step.output[0] * kernel[0] } else { step.frame_taps };
            let per_pixel = taps_done as f64 / kernel[0].max(1) as f64 * batch;
            let calls: Vec<f64> = match &pieces {
                Some(p) => p.iter().map(|[r, c]| (r.len() * c.len()) as f64 * per_pixel).collect(),
                None => vec![step.output[1] as f64 * fh * step.output[2] as f64 * fw * per_pixel],
            };
            let macs_per_output = (step.in_channels * step.out_channels * kernel.iter().product::<usize>()) as f64;
            let (mut fixed_s, mut work_s) = (0.0, 0.0);
            for (i, &outputs) in calls.iter().enumerate() {
                let (fixed, work) = measured.map_or((0.0, outputs * macs_per_output / 1e9), |r| {
                    profile.conv_call_s(r, kernel, [step.in_channels, step.out_channels], outputs)
                });
                if i == 0 || align >= 2 {
                    fixed_s += fixed;
                }
                work_s += work;
            }
            // The weights as the kernel lays them out and its working buffers (on the CPU:
            // `kernels`, the largest of the calls; on a GPU the weights reordered in the element
            // type, and a padded channels-last copy of the input), and the scratch the profile
            // measured beyond them.
            let scratch = if gpu {
                let packed = (step.in_channels * step.out_channels) as f64
                    * kernel.iter().product::<usize>() as f64
                    * network.elem_bytes as f64;
                packed + with_halo * bytes
            } else {
                let windows: Vec<[usize; 2]> = match &pieces {
                    Some(p) => p.iter().map(|[r, c]| [r.len(), c.len()]).collect(),
                    None => vec![[
                        (step.output[1] as f64 * fh).round() as usize,
                        (step.output[2] as f64 * fw).round() as usize,
                    ]],
                };
                let channels = [step.in_channels, step.out_channels];
                let largest =
                    windows.iter().map(|&window| cpu_conv_scratch_bytes(kernel, align, channels, window, threads));
                largest.max().unwrap_or(0) as f64
            } + profile.conv_scratch_bytes as f64;
            // A CPU call's fixed work runs on the rank's threads; a GPU's launches do not speed up.
            // A layer that pads its input copies it first (a pass over both maps).
            let pad_s = if pads { call_s + profile.elementwise_s((input + with_halo) * bytes) / speed } else { 0.0 };
            let compute_s = pad_s + if gpu { fixed_s + work_s / speed } else { (fixed_s + work_s) / speed };
            if overlaps || (!exchanges && !pads) {
                // The interior is computed straight from the input into the output while the
                // rows travel; the edges from small copies: the input and the output live
                // together, and the messages cost what outlasts the interior.
                let comm_s = if exchanges { (profile.message_s(halo) - compute_s).max(0.0) } else { 0.0 };
                let live_bytes = (input + output + resident) * bytes + scratch;
                return StepCost { compute_s, comm_s, live_bytes, received_bytes: halo };
            }
            // While the copy is made, the input is alive beside it; the layer lets it go then.
            let copying = with_halo + input;
            let computing = (with_halo + output) * bytes + scratch;
            StepCost {
                compute_s,
                comm_s: if exchanges { profile.message_s(halo) } else { 0.0 },
                live_bytes: (copying * bytes).max(computing) + resident * bytes,
                received_bytes: halo,
            }
        }
        StepKind::Norm { grouped } => StepCost {
            compute_s: call_s + profile.elementwise_s((input + output) * bytes) / speed,
            comm_s: if grouped && shared { 2.0 * profile.link_latency_us * 1e-6 } else { 0.0 },
            live_bytes: (input + output + resident) * bytes,
            received_bytes: 0.0,
        },
        StepKind::Elementwise { in_place } => StepCost {
            compute_s: call_s
                + profile.elementwise_s(if in_place { 3.0 * input } else { input + output } * bytes) / speed,
            comm_s: 0.0,
            live_bytes: (input + if in_place { 0.0 } else { output } + resident) * bytes,
            received_bytes: 0.0,
        },
        StepKind::Attention => {
            let n = step.input[0] as f64 * step.input[1] as f64 * step.input[2] as f64;
            let rows = (SCORE_BLOCK_ELEMS / n.max(1.0)).clamp(SCORE_MIN_ROWS, SCORE_MAX_ROWS).min(n);
            let gathered = if shared { (whole_input - input) * bytes } else { 0.0 };
            let rate = profile.attention_gmacs * 1e9;
            StepCost {
                compute_s: call_s + step.macs() as f64 * batch / (rate * speed),
                comm_s: if shared { profile.message_s(gathered) } else { 0.0 },
                // The part, the gathered map, q, k, v and the attended map, one block of scores.
                live_bytes: (input + if shared { whole_input } else { 0.0 } + 4.0 * whole_input + resident) * bytes
                    + rows * n * 4.0,
                received_bytes: gathered,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{ConvRate, NetworkBuilder};

    /// One conv rate for every shape, threads that scale perfectly, 1 GB/s element-wise, free
    /// links: predictions by hand.
    fn profile(cores: usize) -> DeviceProfile {
        DeviceProfile {
            device: "test".into(),
            source: "test".into(),
            cores,
            threads: cores,
            thread_efficiency: 1.0,
            thread_efficiency_3d: None,
            kind: DeviceKind::Cpu,
            dtype: "f32".into(),
            convs: vec![ConvRate {
                kernel: [1, 3, 3],
                align: 1,
                in_channels: 8,
                out_channels: 8,
                gmacs: 1.0,
                call_us: 0.0,
                times: Vec::new(),
            }],
            elementwise_gbps: 1.0,
            attention_gmacs: 1.0,
            op_call_us: 0.0,
            link_latency_us: 0.0,
            link_gbps: 1e6,
            conv_scratch_bytes: 0,
            conv_choices: Vec::new(),
        }
    }

    /// Two 3×3 convolutions of 8 channels on a 16×16 latent, f32.
    fn two_convs(h: usize, w: usize) -> Network {
        let mut b = NetworkBuilder::new(8, [1, h, w], [h, w], 4, 1);
        b.conv(8, [1, 3, 3], 1, 0).conv(8, [1, 3, 3], 1, 0);
        b.finish()
    }

    const ONE: Placement = Placement { threads_per_rank: 1.0, ranks_per_host: 1, threads_alone: 1.0 };

    /// A convolution whose layer pads its input into a copy (replicated edges) holds that
    /// copy beside its input, then beside its output, even with no neighbour, and pays a pass
    /// over both maps to make it.
    #[test]
    fn a_padding_layer_holds_and_pays_its_copy() {
        let mut b = NetworkBuilder::new(8, [1, 16, 16], [16, 16], 4, 1);
        b.push(StepKind::Conv { kernel: [1, 3, 3], align: 1, overlapped: false, pads: true }, 8, [1, 16, 16], 0);
        let net = b.finish();
        let p = predict(&net, Layout::Direct, ONE, &profile(1)).unwrap();
        let (map, padded) = ((8 * 16 * 16 * 4) as f64, (8 * 18 * 18 * 4) as f64);
        let copy_s = (map + padded) / 1e9;
        assert!((p.ms - (net.macs() as f64 / 1e9 + copy_s) * 1e3).abs() < 1e-9, "{p:?}");
        assert_eq!(p.peak_bytes, (map + padded) as u64 + cpu_conv_scratch_bytes([1, 3, 3], 1, [8, 8], [16, 16], 1));
        assert_eq!(p.ranks[0].comm_s, 0.0);
    }

    #[test]
    fn the_direct_pass_costs_its_multiply_adds_at_the_profiles_rate() {
        let net = two_convs(16, 16);
        assert_eq!(net.macs(), 2 * 16 * 16 * 8 * 8 * 9);
        let p = predict(&net, Layout::Direct, ONE, &profile(1)).unwrap();
        assert!((p.ms - net.macs() as f64 / 1e9 * 1e3).abs() < 1e-9, "{p:?}");
        // Input, output and the convolution's packed weights and row buffers.
        let scratch = cpu_conv_scratch_bytes([1, 3, 3], 1, [8, 8], [16, 16], 1);
        assert_eq!(p.peak_bytes, (2 * 8 * 16 * 16 * 4) as u64 + scratch);
        assert_eq!(p.ranks[0].received_bytes, 0);
    }

    #[test]
    fn a_parts_convolutions_take_the_measured_time_at_the_parts_size() {
        // 1 ms fixed, then 1 µs a position to 128 positions, 3 µs beyond.
        let times = vec![[64.0, 0.001064], [128.0, 0.001128], [256.0, 0.001512]];
        let p = DeviceProfile { convs: vec![ConvRate { times, ..profile(2).convs[0].clone() }], ..profile(2) };
        let net = two_convs(32, 16);
        // 512 positions: beyond the largest size, at its average rate.
        let direct = predict(&net, Layout::Direct, ONE, &p).unwrap();
        assert!((direct.ranks[0].compute_s - 2.0 * 2.0 * 0.001512).abs() < 1e-12, "{direct:?}");
        // Two bands of 256 positions, each overlapped in two direct pieces: the interior's
        // 240 and the edge's 16, each at its own size, the packing paid once.
        let placement = Placement { threads_per_rank: 1.0, ranks_per_host: 2, threads_alone: 1.0 };
        let bands = predict(&net, Layout::Bands { axis: ShardAxis::Height, ranks: 2 }, placement, &p).unwrap();
        let pieces = 0.001 + (0.001128 + 112.0 * 3e-6 - 0.001) + 16e-6;
        for rank in &bands.ranks {
            assert!((rank.compute_s - 2.0 * pieces).abs() < 1e-12, "{rank:?}");
        }
        // A GPU profile keeps its rate and call cost: no times.
        let gpu = DeviceProfile { kind: DeviceKind::Cuda, dtype: "bf16".into(), ..p.clone() };
        assert!(gpu.validate().unwrap_err().contains("not times"));
    }

    #[test]
    fn a_causal_convolution_skips_its_padding_taps_and_a_band_holds_its_caches_edges() {
        let mut b = NetworkBuilder::new(8, [4, 16, 16], [16, 16], 4, 1);
        // Behind no cached frame: two zero frames in front, 1 + 2 + 3 + 3 taps.
        b.set_resident_edges([100, 50]).causal_conv(8, [3, 3, 3], 1, 0, 0);
        let net = b.finish();
        let step = &net.steps[0];
        assert_eq!(step.frame_taps, 9);
        assert_eq!(step.macs(), 16 * 16 * 9 * 8 * 8 * 9);
        let p = predict(&net, Layout::Direct, ONE, &profile(1)).unwrap();
        assert!((p.ms - step.macs() as f64 / 1e9 * 1e3).abs() < 1e-9, "{p:?}");
        // A GPU computes the padding taps: all 12.
        let gpu = DeviceProfile { kind: DeviceKind::Cuda, dtype: "f32".into(), ..profile(1) };
        let q = predict(&net, Layout::Direct, ONE, &gpu).unwrap();
        assert!((q.ms - (16 * 16 * 12 * 8 * 8 * 9) as f64 / 1e9 * 1e3).abs() < 1e-9, "{q:?}");
        // A band with one neighbour holds one more row of the caches (its share of the
        // width: all of it) than its share of the resident maps.
        let placement = Placement { threads_per_rank: 1.0, ranks_per_host: 2, threads_alone: 1.0 };
        let bands = predict(&net, Layout::Bands { axis: ShardAxis::Height, ranks: 2 }, placement, &profile(2)).unwrap();
        let mut plain = net.clone();
        plain.steps[0].resident_edges = [0, 0];
        let without =
            predict(&plain, Layout::Bands { axis: ShardAxis::Height, ranks: 2 }, placement, &profile(2)).unwrap();
        assert_eq!(bands.ranks[1].peak_bytes, without.ranks[1].peak_bytes + 100 * 4, "{bands:?}");
    }

    #[test]
    fn the_breakdown_puts_each_steps_compute_under_its_kind() {
        let mut b = NetworkBuilder::new(8, [1, 16, 16], [16, 16], 4, 1);
        b.conv(8, [1, 3, 3], 4, 0).norm(true, 0).add(0);
        let net = b.finish();
        let whole = two_convs(16, 16);
        let tiles = [net.clone(), net.clone()];
        let layout = Layout::Tiles { tiles: &tiles, ranks: 1, stitched: true };
        for p in [
            predict(&net, Layout::Direct, ONE, &profile(1)).unwrap(),
            predict(&whole, layout, ONE, &profile(1)).unwrap(),
        ] {
            let kinds = &p.ranks[0].compute_by_kind;
            let sum: f64 = kinds.values().sum();
            assert!((sum - p.ranks[0].compute_s).abs() < 1e-12, "{p:?}");
            // The 3x3 convolution aligned to 4 runs Winograd F(4x4) on a CPU: its work at the rate.
            let conv = net.steps[0].macs() as f64 / 1e9 * if kinds.contains_key("blend") { 2.0 } else { 1.0 };
            assert!((kinds["conv 3x3 F(4x4)"] - conv).abs() < 1e-12, "{kinds:?}");
            assert!(kinds["norm"] > 0.0 && kinds["element-wise"] > 0.0, "{kinds:?}");
        }
        assert_eq!(
            StepKind::Conv { kernel: [3, 3, 3], align: 1, overlapped: true, pads: false }.label(true),
            "conv 3x3x3 direct"
        );
        assert_eq!(
            StepKind::Conv { kernel: [3, 3, 3], align: 2, overlapped: true, pads: false }.label(false),
            "conv 3x3x3"
        );
        assert_eq!(
            StepKind::Conv { kernel: [1, 1, 1], align: 4, overlapped: true, pads: false }.label(true),
            "conv 1x1"
        );
    }

    #[test]
    fn bands_split_the_work_and_exchange_one_halo_row_per_neighbour() {
        let net = two_convs(16, 16);
        let placement = Placement { threads_per_rank: 1.0, ranks_per_host: 2, threads_alone: 1.0 };
        let p = predict(&net, Layout::Bands { axis: ShardAxis::Height, ranks: 2 }, placement, &profile(2)).unwrap();
        // Each rank has half the work, on a core of its own.
        let half = net.macs() as f64 / 2.0 / 1e9;
        for rank in &p.ranks {
            assert!((rank.compute_s - half).abs() < 1e-12, "{rank:?}");
        }
        // One row of 16 columns × 8 channels per convolution, and the owner gathers the
        // other band's output (8 rows).
        assert_eq!(p.ranks[1].received_bytes, 2 * 16 * 8 * 4);
        assert_eq!(p.ranks[0].received_bytes, 2 * 16 * 8 * 4 + 8 * 16 * 8 * 4);
        let direct = predict(&net, Layout::Direct, ONE, &profile(2)).unwrap();
        assert!(p.ranks[1].peak_bytes < direct.peak_bytes, "{p:?} vs {direct:?}");
    }

    #[test]
    fn two_by_two_blocks_send_about_half_the_busiest_ranks_halo_of_four_bands() {
        let net = two_convs(64, 64);
        let placement = Placement { threads_per_rank: 1.0, ranks_per_host: 4, threads_alone: 1.0 };
        let bands = predict(&net, Layout::Bands { axis: ShardAxis::Height, ranks: 4 }, placement, &profile(4)).unwrap();
        let blocks = predict(&net, Layout::Blocks { grid: [2, 2] }, placement, &profile(4)).unwrap();
        let busiest = |p: &Prediction| p.ranks.iter().skip(1).map(|r| r.received_bytes).max().unwrap();
        let ratio = busiest(&blocks) as f64 / busiest(&bands) as f64;
        // A block receives 32 + 32 edge values and one corner per convolution; a middle band
        // two rows of 64.
        assert!((ratio - 65.0 / 128.0).abs() < 1e-9, "{ratio}");
    }

    #[test]
    fn tiles_are_dealt_by_their_work_and_the_owner_holds_the_output() {
        let whole = two_convs(32, 32);
        let tiles: Vec<Network> = (0..4).map(|_| two_convs(16, 16)).collect();
        let placement = Placement { threads_per_rank: 1.0, ranks_per_host: 2, threads_alone: 1.0 };
        let layout = Layout::Tiles { tiles: &tiles, ranks: 2, stitched: true };
        let p = predict(&whole, layout, placement, &profile(2)).unwrap();
        let tile_s = tiles[0].macs() as f64 / 1e9;
        assert!((p.ranks[1].compute_s - 2.0 * tile_s).abs() < 1e-12, "{p:?}");
        // The owner computes its tiles beside the output and a round of tiles.
        let round = 2 * tiles[0].output_bytes();
        assert!(p.ranks[0].peak_bytes >= p.ranks[1].peak_bytes + whole.output_bytes() + round, "{p:?}");
        assert_eq!(p.ranks[0].received_bytes, 2 * tiles[0].output_bytes());
        // Gathering every tile first: the owner holds them all beside the output.
        let gathered = Layout::Tiles { tiles: &tiles, ranks: 2, stitched: false };
        let q = predict(&whole, gathered, placement, &profile(2)).unwrap();
        assert!(q.ranks[0].peak_bytes >= whole.output_bytes() + 4 * tiles[0].output_bytes(), "{q:?}");
    }

    #[test]
    fn a_gpu_pays_each_calls_fixed_cost_and_exchanges_halos_before_its_convolutions() {
        let net = two_convs(16, 16);
        let with = |kind: DeviceKind| DeviceProfile {
            kind,
            link_latency_us: 5.0,
            convs: vec![ConvRate { call_us: 10.0, ..profile(2).convs[0].clone() }],
            ..profile(2)
        };
        let gpu = with(DeviceKind::Cuda);
        let direct = predict(&net, Layout::Direct, ONE, &gpu).unwrap();
        // Two convolutions, each 10 µs beyond its multiply-adds.
        let expected = net.macs() as f64 / 1e9 + 20e-6;
        assert!((direct.ms - expected * 1e3).abs() < 1e-9, "{direct:?}");
        // Input, its padded copy, output, and the weights in the element type.
        assert_eq!(direct.peak_bytes, (3 * 8 * 16 * 16 * 4 + 8 * 8 * 9 * 4) as u64);
        // On bands the CPU hides each 5 µs message behind the interior's compute; the GPU
        // pays it before each of the two convolutions.
        let placement = Placement { threads_per_rank: 1.0, ranks_per_host: 2, threads_alone: 1.0 };
        let bands = Layout::Bands { axis: ShardAxis::Height, ranks: 2 };
        let cpu = predict(&net, bands, placement, &with(DeviceKind::Cpu)).unwrap();
        let gpu = predict(&net, bands, placement, &gpu).unwrap();
        let halo = (16 * 8 * 4) as f64;
        assert_eq!(cpu.ranks[1].comm_s, 0.0, "{cpu:?}");
        assert!((gpu.ranks[1].comm_s - 2.0 * with(DeviceKind::Cuda).message_s(halo)).abs() < 1e-15, "{gpu:?}");
    }

    #[test]
    fn a_cpu_calls_fixed_cost_scales_with_the_weights_and_is_paid_per_winograd_piece() {
        let with_call =
            DeviceProfile { convs: vec![ConvRate { call_us: 100.0, ..profile(1).convs[0].clone() }], ..profile(1) };
        // 16 channels: four times the measured shape's weights, four times its fixed cost.
        let mut b = NetworkBuilder::new(16, [1, 16, 16], [16, 16], 4, 1);
        b.conv(16, [1, 3, 3], 1, 0);
        let net = b.finish();
        let p = predict(&net, Layout::Direct, ONE, &with_call).unwrap();
        assert!((p.ms - (net.macs() as f64 / 1e9 + 400e-6) * 1e3).abs() < 1e-9, "{p:?}");

        // Two bands of a map large enough for Winograd to overlap: each band computes its
        // interior and one edge strip, two calls, where the direct kernel packs once.
        let bands = |align: usize| {
            let mut b = NetworkBuilder::new(8, [1, 256, 256], [256, 256], 4, 1);
            b.conv(8, [1, 3, 3], align, 0);
            let placement = Placement { threads_per_rank: 1.0, ranks_per_host: 1, threads_alone: 1.0 };
            let layout = Layout::Bands { axis: ShardAxis::Height, ranks: 2 };
            predict(&b.finish(), layout, placement, &with_call).unwrap().ranks[1].compute_s
        };
        assert!((bands(4) - bands(1) - 100e-6).abs() < 1e-12, "{} vs {}", bands(4), bands(1));
    }

    #[test]
    fn ranks_that_share_cores_share_their_speed() {
        // Two cores, the second adding half a core's speed; 3-D convolutions scale perfectly.
        let p = DeviceProfile { thread_efficiency: 0.5, thread_efficiency_3d: Some(1.0), ..profile(2) };
        assert_eq!(p.speedup(1.0, 1), 1.0);
        assert_eq!(p.speedup(2.0, 1), 1.5);
        // Two ranks of a thread each: the host's 1.5× shared, as two threads of one rank.
        assert_eq!(p.speedup(1.0, 2), 0.75);
        // Four ranks on a pool of two threads, or of two threads each: a quarter of 1.5× each.
        assert_eq!(p.speedup(0.5, 4), 0.375);
        assert_eq!(p.speedup(2.0, 4), 0.375);
        assert_eq!(p.speedup_video(1.0, 2), 1.0);
        assert_eq!(p.speedup_video(2.0, 1), 2.0);
        // Half a thread alone: half the speed.
        assert_eq!(p.speedup(0.5, 1), 0.5);
    }

    #[test]
    fn a_grid_or_a_band_count_that_cannot_cut_the_latent_is_an_error() {
        let net = two_convs(2, 2);
        assert!(predict(&net, Layout::Bands { axis: ShardAxis::Width, ranks: 3 }, ONE, &profile(1)).is_err());
        assert!(predict(&net, Layout::Blocks { grid: [3, 1] }, ONE, &profile(1)).is_err());
        assert!(predict(&net, Layout::Tiles { tiles: &[], ranks: 0, stitched: true }, ONE, &profile(1)).is_err());
    }
}
