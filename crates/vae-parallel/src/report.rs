//! Request reports: per-rank summaries gathered to rank 0, rendered as a table, JSON or an SVG
//! plot ([`RequestReport::to_svg`]).

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};
use vae_runtime::{RankReport, StrategyReport};
use vae_transport::{Communicator, CommunicatorExt, TransportError};

mod svg;

/// Traffic of one kind of collective.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrafficSummary {
    /// Collective kind.
    pub op: String,
    /// Calls.
    pub calls: u64,
    /// Bytes sent.
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
}

/// One rank's part of a request, in plain serialisable units.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankSummary {
    /// The rank.
    pub rank: usize,
    /// Tiles it executed.
    pub tiles: Vec<usize>,
    /// Their total workload.
    pub workload: u64,
    /// Whether it merged.
    pub is_owner: bool,
    /// Milliseconds per phase: split, agree, exec, gather, merge, broadcast.
    pub phase_ms: PhaseMs,
    /// Traffic by collective kind (kinds with no calls left out).
    pub traffic: Vec<TrafficSummary>,
    /// Peak tensor memory of the rank during the request, bytes.
    pub peak_bytes: u64,
    /// Peak tensor memory at the end of the computation (before outputs are gathered; for tiles
    /// stitched as they arrive, the owner's includes the output), bytes.
    pub exec_peak_bytes: u64,
    /// Tensor memory alive when the request started (the input, weights charged to the rank),
    /// bytes: `peak_bytes - start_bytes` is the most the request itself held.
    #[serde(default)]
    pub start_bytes: u64,
    /// Peak device (CUDA) tensor memory during the request, bytes (0 on the CPU).
    #[serde(default)]
    pub device_peak_bytes: u64,
    /// Shard mode: this rank's latent rows (or columns) `[start, end)`; absent on idle ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub band: Option<[usize; 2]>,
    /// 2-D shard: this rank's latent rows and columns `[[start, end], [start, end]]`; absent on
    /// idle ranks and in other modes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<[[usize; 2]; 2]>,
    /// Shard mode: halo rows sent, bytes.
    #[serde(default)]
    pub halo_bytes_sent: u64,
    /// Shard mode: halo exchanges made.
    #[serde(default)]
    pub halo_exchanges: u64,
    /// Shard mode: of those, the exchanges that ran while the convolution's interior was
    /// computed.
    #[serde(default)]
    pub halo_overlapped: u64,
    /// Shard mode: milliseconds the computation was blocked waiting for its neighbours' halos
    /// (part of `phase_ms.halo`).
    #[serde(default)]
    pub halo_wait_ms: f64,
    /// Shard mode: bytes sent to assemble full maps (attention).
    #[serde(default)]
    pub map_bytes_sent: u64,
    /// Shard mode: bytes of GroupNorm statistics sent.
    #[serde(default)]
    pub norm_bytes_sent: u64,
    /// Shard mode: exchanges of GroupNorm statistics.
    #[serde(default)]
    pub norm_exchanges: u64,
    /// Pipeline mode: this rank's stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<StageSummary>,
}

/// One rank's stage of a pipeline request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageSummary {
    /// Its index (`None` on ranks beyond the stages).
    pub stage: Option<usize>,
    /// Stages in the pipeline.
    pub stages: usize,
    /// The model steps (layers) it ran, `[start, end)` of `total_steps`.
    pub steps: [usize; 2],
    /// Steps of the whole model.
    pub total_steps: usize,
    /// Its share of the predicted cost (0..1).
    pub cost_share: f64,
    /// The bytes of its weights.
    pub weight_bytes: u64,
    /// Runs (latent frames) it computed.
    pub runs: usize,
    /// Bytes it handed to the next stage (the last stage: to the owner).
    pub bytes_out: u64,
    /// Milliseconds computing.
    pub busy_ms: f64,
    /// Milliseconds in hand-overs (waiting for its neighbours, and the transfers).
    pub idle_ms: f64,
}

/// Milliseconds per phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseMs {
    /// Split.
    pub split: f64,
    /// Input agreement.
    pub agree: f64,
    /// Computation (tiles, or this rank's band without the communication inside it).
    pub exec: f64,
    /// Shard mode: halo exchanges and full-map gathers inside the computation.
    #[serde(default)]
    pub halo: f64,
    /// Shape exchange and gather.
    pub gather: f64,
    /// Merge.
    pub merge: f64,
    /// Final broadcast.
    pub broadcast: f64,
    /// Sum.
    pub total: f64,
}

impl RankSummary {
    /// Bytes sent over every kind of collective.
    pub fn bytes_sent(&self) -> u64 {
        self.traffic.iter().map(|t| t.bytes_sent).sum()
    }

    /// Bytes received over every kind of collective.
    pub fn bytes_received(&self) -> u64 {
        self.traffic.iter().map(|t| t.bytes_received).sum()
    }
}

impl From<&RankReport> for RankSummary {
    fn from(r: &RankReport) -> Self {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let t = &r.timings;
        Self {
            rank: r.rank,
            tiles: r.tiles.clone(),
            workload: r.workload,
            is_owner: r.is_owner,
            phase_ms: PhaseMs {
                split: ms(t.split),
                agree: ms(t.agree),
                exec: ms(t.exec),
                halo: ms(t.halo),
                gather: ms(t.gather),
                merge: ms(t.merge),
                broadcast: ms(t.broadcast),
                total: ms(t.total()),
            },
            traffic: r
                .traffic
                .by_kind()
                .iter()
                .filter(|(_, s)| s.calls > 0)
                .map(|(op, s)| TrafficSummary {
                    op: (*op).to_string(),
                    calls: s.calls,
                    bytes_sent: s.bytes_sent,
                    bytes_received: s.bytes_received,
                })
                .collect(),
            peak_bytes: r.peak_bytes as u64,
            exec_peak_bytes: r.exec_peak_bytes as u64,
            start_bytes: r.start_bytes as u64,
            device_peak_bytes: r.device_peak_bytes as u64,
            band: match &r.strategy {
                StrategyReport::Shard { band: Some(b), .. } => Some([b.start, b.end]),
                _ => None,
            },
            block: match &r.strategy {
                StrategyReport::Blocks { block: Some([rows, cols]), .. } => {
                    Some([[rows.start, rows.end], [cols.start, cols.end]])
                }
                _ => None,
            },
            halo_bytes_sent: shard_traffic(r).map_or(0, |t| t.halo_bytes_sent),
            halo_exchanges: shard_traffic(r).map_or(0, |t| t.halo_exchanges),
            halo_overlapped: shard_traffic(r).map_or(0, |t| t.halo_overlapped),
            halo_wait_ms: shard_traffic(r).map_or(0.0, |t| ms(t.halo_wait)),
            map_bytes_sent: shard_traffic(r).map_or(0, |t| t.map_bytes_sent),
            norm_bytes_sent: shard_traffic(r).map_or(0, |t| t.norm_bytes_sent),
            norm_exchanges: shard_traffic(r).map_or(0, |t| t.norm_exchanges),
            pipeline: match &r.strategy {
                StrategyReport::Pipeline(p) => Some(StageSummary {
                    stage: p.stage,
                    stages: p.stages,
                    steps: [p.steps.start, p.steps.end],
                    total_steps: p.total_steps,
                    cost_share: f64::from(p.cost_share_ppm) / 1e6,
                    weight_bytes: p.weight_bytes,
                    runs: p.runs,
                    bytes_out: p.bytes_out,
                    busy_ms: ms(p.busy),
                    idle_ms: ms(p.idle),
                }),
                _ => None,
            },
        }
    }
}

fn shard_traffic(r: &RankReport) -> Option<vae_runtime::ShardTraffic> {
    match &r.strategy {
        StrategyReport::Shard { traffic, .. } | StrategyReport::Blocks { traffic, .. } => Some(*traffic),
        StrategyReport::Tile | StrategyReport::Pipeline(_) => None,
    }
}

/// A whole request as seen by every rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestReport {
    /// The mode the request asked for (`tile`, `auto`, `spatial_shard_height`, ...).
    pub mode: String,
    /// What ran: `tile`, `shard-height`, `shard-width`, `shard-RxC` (blocks) or `pipeline`.
    pub strategy: String,
    /// Why (the model family's choice or fallback).
    pub reason: String,
    /// What ran is not what the request asked for (a forced mode that fell back, untiled
    /// pixels computed on one rank); `reason` says why.
    #[serde(default)]
    pub fallback: bool,
    /// Transport backend.
    pub backend: String,
    /// Ranks in the group.
    pub world_size: usize,
    /// Ranks that executed tiles.
    pub parallel_size: usize,
    /// Tiles in the plan (0 for a shard request).
    pub tile_count: usize,
    /// The cost model's predicted latency for the strategy that ran, milliseconds (compare
    /// with the ranks' `phase_ms.total`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_ms: Option<f64>,
    /// Its predicted peak bytes on the busiest rank, above what was alive when the request
    /// started (compare with the ranks' `peak_bytes - start_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_peak_bytes: Option<u64>,
    /// Per rank, in rank order.
    pub ranks: Vec<RankSummary>,
}

impl RequestReport {
    /// The report of a request in `mode` from the owner's own [`RankReport`] (strategy, reason,
    /// prediction) and every rank's summary, on a group of `comm` with `parallel_size` ranks
    /// executing.
    pub fn from_owner(
        mode: &str,
        owner: &RankReport,
        comm: &dyn Communicator,
        parallel_size: usize,
        ranks: Vec<RankSummary>,
    ) -> Self {
        Self {
            mode: mode.to_string(),
            strategy: owner.strategy.label(),
            reason: owner.reason.clone().unwrap_or_default(),
            fallback: owner.fallback,
            backend: comm.backend().to_string(),
            world_size: comm.size(),
            parallel_size,
            tile_count: owner.tile_count,
            predicted_ms: owner.predicted.map(|p| p.ms),
            predicted_peak_bytes: owner.predicted.map(|p| p.peak_bytes),
            ranks,
        }
    }

    /// What a report file at `path` holds: the SVG plot for a `.svg` name, JSON otherwise.
    pub fn file_bytes(&self, path: &Path) -> Result<Vec<u8>, serde_json::Error> {
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg")) {
            Ok(self.to_svg().into_bytes())
        } else {
            serde_json::to_vec_pretty(self)
        }
    }

    /// What ran, in a few words: `12 tile(s)` or the shard strategy (`shard-width`).
    pub fn what_ran(&self) -> String {
        match self.strategy.as_str() {
            "tile" => format!("{} tile(s)", self.tile_count),
            other => other.to_string(),
        }
    }

    /// What `rank` computed: its tiles, its band of latent rows (height shard) or columns
    /// (width shard), its stage's model steps (pipeline), or nothing.
    fn work_of(&self, rank: &RankSummary) -> String {
        if let Some(StageSummary { stage: Some(_), steps: [a, b], .. }) = &rank.pipeline {
            return format!("steps {a}..{b}");
        }
        if let Some([[r0, r1], [c0, c1]]) = rank.block {
            return format!("{r0}..{r1} × {c0}..{c1}");
        }
        match (rank.band, self.strategy.as_str()) {
            (Some([a, b]), "shard-width") => format!("cols {a}..{b}"),
            (Some([a, b]), _) => format!("rows {a}..{b}"),
            (None, "tile") => format!("{} tiles", rank.tiles.len()),
            (None, _) => "idle".into(),
        }
    }

    /// A fixed-width table: one row per rank.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:>4}  {:>9}  {:>8}  {:>8}  {:>8}  {:>8}  {:>8}  {:>8}  {:>9}  {:>9}  {:>11}  {:>11}  {:>11}  {:>11}  {:>11}",
            "rank",
            "work",
            "workload",
            "exec ms",
            "halo",
            "gather",
            "merge",
            "bcast",
            "total ms",
            "other ms",
            "sent",
            "received",
            "peak",
            "device peak",
            "halo sent"
        );
        for r in &self.ranks {
            let p = &r.phase_ms;
            let _ = writeln!(
                out,
                "{:>4}  {:>9}  {:>8}  {:>8.2}  {:>8.2}  {:>8.2}  {:>8.2}  {:>8.2}  {:>9.2}  {:>9.2}  {:>11}  {:>11}  {:>11}  {:>11}  {:>11}",
                format!("{}{}", r.rank, if r.is_owner { "*" } else { "" }),
                self.work_of(r),
                r.workload,
                p.exec,
                p.halo,
                p.gather,
                p.merge,
                p.broadcast,
                p.total,
                p.split + p.agree,
                human_bytes(r.bytes_sent()),
                human_bytes(r.bytes_received()),
                human_bytes(r.peak_bytes),
                if r.device_peak_bytes > 0 { human_bytes(r.device_peak_bytes) } else { "-".into() },
                human_bytes(r.halo_bytes_sent),
            );
        }
        out
    }
}

/// Milliseconds as the tables print them: whole from 100 on, two decimals below.
pub fn human_ms(v: f64) -> String {
    if v >= 100.0 { format!("{v:.0}") } else { format!("{v:.2}") }
}

/// `1.5 MiB`-style sizes.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{n} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}

/// Errors of collecting reports.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The gather failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A rank sent something that is not a summary.
    #[error("rank {rank} sent an unreadable report: {source}")]
    Decode {
        /// The rank.
        rank: usize,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

/// Gathers every rank's summary to `root`; `Some` there, `None` elsewhere. Every rank calls it.
pub fn gather_summaries(
    comm: &dyn Communicator,
    root: usize,
    report: &RankReport,
) -> Result<Option<Vec<RankSummary>>, ReportError> {
    let bytes = serde_json::to_vec(&RankSummary::from(report)).expect("a summary always serialises");
    let Some(parts) = comm.gather(root, &bytes)? else {
        return Ok(None);
    };
    parts
        .parts()
        .enumerate()
        .map(|(rank, part)| serde_json::from_slice(part).map_err(|source| ReportError::Decode { rank, source }))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_readable() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(32 << 20), "32.0 MiB");
    }
}
