//! The service's counters, in Prometheus' text format (`GET /metrics`): requests by model, kind
//! and outcome, a latency histogram, the queue's depth, the last request's peak memory per rank,
//! the bytes the ranks sent each other, and the group's rebuilds.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::RequestReport;

/// The latency histogram's upper bounds, seconds.
const BUCKETS: [f64; 12] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0];

/// One histogram: counts per bucket (cumulative when written), the sum and the count.
#[derive(Default, Clone)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        if let Some(i) = BUCKETS.iter().position(|&b| seconds <= b) {
            self.counts[i] += 1;
        }
        self.sum += seconds;
        self.count += 1;
    }
}

#[derive(Default)]
struct Inner {
    /// (model, kind, outcome) → requests.
    requests: BTreeMap<(String, String, String), u64>,
    /// (model, kind) → latency of the requests that succeeded, arrival to answer.
    latency: BTreeMap<(String, String), Histogram>,
    /// The last request's peak tensor memory per rank, bytes (above what was alive at its start).
    last_peak: Vec<u64>,
}

/// The service's metrics.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
    /// Requests waiting for the group (not the one running).
    pub queued: AtomicUsize,
    /// Requests running on the group (0 or 1).
    pub running: AtomicUsize,
    /// Bytes the ranks sent each other, all requests.
    bytes_between_ranks: AtomicU64,
    /// Times the group was rebuilt after a rank failed.
    pub rebuilds: AtomicU64,
    /// How long the last rebuild took, milliseconds.
    pub last_rebuild_ms: AtomicU64,
}

impl Metrics {
    /// A request ended with `outcome` (`ok`, or the HTTP status class's reason) after `seconds`.
    pub fn request(&self, model: &str, kind: &str, outcome: &str, seconds: f64) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        *inner.requests.entry((model.into(), kind.into(), outcome.into())).or_default() += 1;
        if outcome == "ok" {
            inner.latency.entry((model.into(), kind.into())).or_default().observe(seconds);
        }
    }

    /// What a finished request's report says about the ranks.
    pub fn report(&self, report: &RequestReport) {
        let sent: u64 = report.ranks.iter().map(|r| r.traffic.iter().map(|t| t.bytes_sent).sum::<u64>()).sum();
        self.bytes_between_ranks.fetch_add(sent, Ordering::Relaxed);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.last_peak = report.ranks.iter().map(|r| r.peak_bytes.saturating_sub(r.start_bytes)).collect();
    }

    /// The mean latency of the requests that succeeded, seconds (0 before any): how long a
    /// client refused by a full queue is told to wait.
    pub fn mean_seconds(&self) -> f64 {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (sum, count) = inner.latency.values().fold((0.0, 0), |(s, c), h| (s + h.sum, c + h.count));
        if count == 0 { 0.0 } else { sum / count as f64 }
    }

    /// The Prometheus text exposition; `ready` is the service's readiness.
    pub fn render(&self, ready: bool) -> String {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        out.push_str("# HELP vae_requests_total Requests answered, by model, kind and outcome.\n");
        out.push_str("# TYPE vae_requests_total counter\n");
        for ((model, kind, outcome), n) in &inner.requests {
            let _ = writeln!(out, "vae_requests_total{{model=\"{model}\",kind=\"{kind}\",outcome=\"{outcome}\"}} {n}");
        }
        out.push_str("# HELP vae_request_seconds Latency of the requests that succeeded, arrival to answer.\n");
        out.push_str("# TYPE vae_request_seconds histogram\n");
        for ((model, kind), h) in &inner.latency {
            let mut cumulative = 0;
            for (bound, n) in BUCKETS.iter().zip(h.counts) {
                cumulative += n;
                let _ = writeln!(
                    out,
                    "vae_request_seconds_bucket{{model=\"{model}\",kind=\"{kind}\",le=\"{bound}\"}} {cumulative}"
                );
            }
            let _ = writeln!(
                out,
                "vae_request_seconds_bucket{{model=\"{model}\",kind=\"{kind}\",le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(out, "vae_request_seconds_sum{{model=\"{model}\",kind=\"{kind}\"}} {}", h.sum);
            let _ = writeln!(out, "vae_request_seconds_count{{model=\"{model}\",kind=\"{kind}\"}} {}", h.count);
        }
        let gauge = |out: &mut String, name: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}");
        };
        gauge(
            &mut out,
            "vae_queue_depth",
            "Requests waiting for the group.",
            self.queued.load(Ordering::Relaxed).to_string(),
        );
        gauge(
            &mut out,
            "vae_requests_running",
            "Requests running on the group.",
            self.running.load(Ordering::Relaxed).to_string(),
        );
        gauge(&mut out, "vae_ready", "1 when the group can take requests.", u8::from(ready).to_string());
        out.push_str(
            "# HELP vae_last_request_peak_bytes Peak tensor memory of the last request per rank, above its start.\n",
        );
        out.push_str("# TYPE vae_last_request_peak_bytes gauge\n");
        for (rank, peak) in inner.last_peak.iter().enumerate() {
            let _ = writeln!(out, "vae_last_request_peak_bytes{{rank=\"{rank}\"}} {peak}");
        }
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}");
        };
        counter(
            &mut out,
            "vae_bytes_between_ranks_total",
            "Bytes the ranks sent each other.",
            self.bytes_between_ranks.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "vae_group_rebuilds_total",
            "Times the group was rebuilt after a rank failed.",
            self.rebuilds.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "vae_last_rebuild_seconds",
            "How long the last rebuild of the group took.",
            format!("{}", self.last_rebuild_ms.load(Ordering::Relaxed) as f64 / 1000.0),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_holds_counters_and_cumulative_buckets() {
        let m = Metrics::default();
        m.request("sd", "decode", "ok", 0.2);
        m.request("sd", "decode", "ok", 3.0);
        m.request("sd", "decode", "invalid_input", 0.0);
        let text = m.render(true);
        assert!(text.contains("vae_requests_total{model=\"sd\",kind=\"decode\",outcome=\"ok\"} 2"), "{text}");
        assert!(text.contains("vae_request_seconds_bucket{model=\"sd\",kind=\"decode\",le=\"0.25\"} 1"), "{text}");
        assert!(text.contains("vae_request_seconds_bucket{model=\"sd\",kind=\"decode\",le=\"5\"} 2"), "{text}");
        assert!(text.contains("vae_ready 1"));
    }
}
