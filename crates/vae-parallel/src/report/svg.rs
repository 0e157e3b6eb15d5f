//! The request report as an SVG plot: one horizontal bar per rank, its phases stacked in the
//! order they run, on one millisecond axis, so an idle rank, a slow owner merge or a rank
//! waiting on its halos shows at a glance. Plain SVG 1.1 with no script or external resource:
//! any browser or image viewer opens it, and each segment's tooltip gives its exact time.

use std::fmt::Write as _;

use super::{RankSummary, RequestReport, human_bytes, human_ms};

/// Left column: rank labels; right column: memory and traffic.
const LABEL_WIDTH: f64 = 130.0;
const PLOT_WIDTH: f64 = 620.0;
const NOTE_WIDTH: f64 = 300.0;
const WIDTH: f64 = LABEL_WIDTH + PLOT_WIDTH + NOTE_WIDTH;
const TOP: f64 = 58.0;
const BAR_HEIGHT: f64 = 22.0;
const ROW_HEIGHT: f64 = 34.0;

/// The phases in the order a rank runs them, with their colours. Halo exchanges happen inside
/// the computation; they are drawn after it, as the time the computation spent waiting on them.
const PHASES: [(&str, &str); 6] = [
    ("split + agree", "#9e9e9e"),
    ("exec", "#3b73b9"),
    ("halo", "#f28e2b"),
    ("gather", "#59a14f"),
    ("merge", "#8e6bb8"),
    ("broadcast", "#e15759"),
];

/// The phase durations of one rank, in [`PHASES`] order, in milliseconds.
fn phase_ms(r: &RankSummary) -> [f64; 6] {
    let p = &r.phase_ms;
    [p.split + p.agree, p.exec, p.halo, p.gather, p.merge, p.broadcast]
}

/// An axis step of 1, 2 or 5 times a power of ten that puts at most six ticks on `0..=max`.
fn tick_step(max: f64) -> f64 {
    let rough = max / 5.0;
    let magnitude = 10f64.powf(rough.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * magnitude).find(|&s| s >= rough).unwrap_or(10.0 * magnitude)
}

/// `text` with the five XML special characters escaped.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// A tick label: as many decimals as the step needs, so 0, 10, 20 or 0.5, 1.0, 1.5.
fn tick_label(t: f64, step: f64) -> String {
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{t:.decimals$}")
}

impl RequestReport {
    /// The report as a standalone SVG document (see the module doc).
    pub fn to_svg(&self) -> String {
        let max_total = self.ranks.iter().map(|r| phase_ms(r).iter().sum::<f64>()).fold(0.0, f64::max);
        // A request that took no measurable time still gets a drawable axis.
        let step = tick_step(max_total.max(1e-3));
        let axis_end = (max_total / step).ceil().max(1.0) * step;
        let x = |t: f64| LABEL_WIDTH + t / axis_end * PLOT_WIDTH;
        let plot_bottom = TOP + ROW_HEIGHT * self.ranks.len() as f64;
        let height = plot_bottom + 64.0;

        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(svg, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
        let _ = writeln!(
            svg,
            r#"<text x="10" y="20" font-size="14" font-weight="bold">{}</text>"#,
            escape(&format!(
                "{} on {} rank(s), {} transport, parallel size {}",
                self.what_ran(),
                self.world_size,
                self.backend,
                self.parallel_size
            ))
        );
        let _ = writeln!(
            svg,
            r##"<text x="10" y="38" fill="#555555">{}</text>"##,
            escape(&format!("mode {}: {}", self.mode, self.reason))
        );

        // Grid lines and tick labels.
        let ticks = (axis_end / step).round() as usize;
        for i in 0..=ticks {
            let t = i as f64 * step;
            let _ = writeln!(
                svg,
                r##"<line x1="{0:.2}" y1="{TOP}" x2="{0:.2}" y2="{plot_bottom}" stroke="#e0e0e0"/><text x="{0:.2}" y="{1}" text-anchor="middle" fill="#555555">{2}</text>"##,
                x(t),
                plot_bottom + 16.0,
                tick_label(t, step)
            );
        }
        let _ = writeln!(
            svg,
            r##"<text x="{:.2}" y="{}" text-anchor="middle" fill="#555555">milliseconds</text>"##,
            LABEL_WIDTH + PLOT_WIDTH / 2.0,
            plot_bottom + 32.0
        );

        for (row, r) in self.ranks.iter().enumerate() {
            let y = TOP + ROW_HEIGHT * row as f64 + (ROW_HEIGHT - BAR_HEIGHT) / 2.0;
            let work = self.work_of(r);
            let _ = writeln!(
                svg,
                r##"<text x="10" y="{:.2}">rank {}{} <tspan fill="#555555">{}</tspan></text>"##,
                y + BAR_HEIGHT * 0.7,
                r.rank,
                if r.is_owner { "*" } else { "" },
                escape(&work)
            );
            let mut start = 0.0;
            let _ = writeln!(svg, r#"<g class="rank" data-rank="{}">"#, r.rank);
            for ((name, colour), d) in PHASES.iter().zip(phase_ms(r)) {
                if d > 0.0 {
                    let _ = writeln!(
                        svg,
                        r#"<rect class="phase" data-phase="{name}" x="{:.3}" y="{y:.2}" width="{:.3}" height="{BAR_HEIGHT}" fill="{colour}"><title>rank {}: {name} {} ms</title></rect>"#,
                        x(start),
                        x(start + d) - x(start),
                        r.rank,
                        human_ms(d)
                    );
                }
                start += d;
            }
            let _ = writeln!(svg, "</g>");
            let device = if r.device_peak_bytes > 0 {
                format!(" · device {}", human_bytes(r.device_peak_bytes))
            } else {
                String::new()
            };
            let _ = writeln!(
                svg,
                r##"<text x="{:.2}" y="{:.2}" fill="#555555">{}</text>"##,
                LABEL_WIDTH + PLOT_WIDTH + 10.0,
                y + BAR_HEIGHT * 0.7,
                escape(&format!(
                    "{} ms · peak {}{device} · sent {}",
                    human_ms(start),
                    human_bytes(r.peak_bytes),
                    human_bytes(r.bytes_sent())
                ))
            );
        }

        // Legend.
        let legend_y = plot_bottom + 46.0;
        let mut lx = LABEL_WIDTH;
        for (name, colour) in PHASES {
            let _ = writeln!(
                svg,
                r#"<rect x="{lx}" y="{legend_y}" width="12" height="12" fill="{colour}"/><text x="{}" y="{}">{name}</text>"#,
                lx + 16.0,
                legend_y + 10.5
            );
            lx += 24.0 + 7.0 * name.len() as f64;
        }
        let _ =
            writeln!(svg, r##"<text x="{}" y="{}" fill="#555555">* owner (merged)</text>"##, lx + 8.0, legend_y + 10.5);
        svg.push_str("</svg>\n");
        svg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{PhaseMs, TrafficSummary};

    fn rank(rank: usize, exec: f64, merge: f64) -> RankSummary {
        RankSummary {
            rank,
            tiles: vec![rank, rank + 2],
            workload: 10,
            is_owner: rank == 0,
            phase_ms: PhaseMs {
                split: 0.5,
                agree: 0.5,
                exec,
                halo: 0.0,
                gather: 2.0,
                merge,
                broadcast: 0.0,
                total: 1.0 + exec + 2.0 + merge,
            },
            traffic: vec![TrafficSummary { op: "gather".into(), calls: 1, bytes_sent: 2048, bytes_received: 0 }],
            peak_bytes: 3 << 20,
            exec_peak_bytes: 2 << 20,
            start_bytes: 1 << 20,
            device_peak_bytes: 0,
            band: None,
            block: None,
            pipeline: None,
            halo_bytes_sent: 0,
            halo_exchanges: 0,
            halo_overlapped: 0,
            halo_wait_ms: 0.0,
            map_bytes_sent: 0,
            norm_bytes_sent: 0,
            norm_exchanges: 0,
        }
    }

    fn report() -> RequestReport {
        RequestReport {
            mode: "tile".into(),
            strategy: "tile".into(),
            reason: "a <reason> & \"quotes\"".into(),
            fallback: false,
            backend: "local".into(),
            world_size: 2,
            parallel_size: 2,
            tile_count: 4,
            predicted_ms: None,
            predicted_peak_bytes: None,
            ranks: vec![rank(0, 97.0, 20.0), rank(1, 47.0, 0.0)],
        }
    }

    /// `(phase, x, width)` of every segment of `rank`'s bar, read back from the parsed document.
    fn segments(svg: &str, rank: usize) -> Vec<(String, f64, f64)> {
        let doc = roxmltree::Document::parse(svg).expect("the SVG is well-formed XML");
        let group = doc
            .descendants()
            .find(|n| n.has_tag_name("g") && n.attribute("data-rank") == Some(&rank.to_string()))
            .expect("one group per rank");
        let number = |n: roxmltree::Node, name: &str| n.attribute(name).unwrap().parse::<f64>().unwrap();
        group
            .children()
            .filter(|n| n.has_tag_name("rect"))
            .map(|n| (n.attribute("data-phase").unwrap().to_string(), number(n, "x"), number(n, "width")))
            .collect()
    }

    #[test]
    fn bars_stack_the_phases_in_order_and_to_scale() {
        let svg = report().to_svg();
        let slow = segments(&svg, 0);
        let names: Vec<&str> = slow.iter().map(|(n, ..)| n.as_str()).collect();
        // Phases of zero duration are not drawn.
        assert_eq!(names, ["split + agree", "exec", "gather", "merge"]);
        for pair in slow.windows(2) {
            assert!((pair[0].1 + pair[0].2 - pair[1].1).abs() < 1e-2, "segments not contiguous: {pair:?}");
        }
        // Both bars start at the axis origin and share one scale: rank 0's exec (97 ms) is
        // 97/47 of rank 1's, and its 120 ms end at 120/150 of an axis of three 50 ms ticks.
        let fast = segments(&svg, 1);
        assert_eq!(slow[0].1, LABEL_WIDTH);
        assert_eq!(fast[0].1, LABEL_WIDTH);
        assert!((slow[1].2 / fast[1].2 - 97.0 / 47.0).abs() < 1e-3);
        let end = slow.last().map(|(_, x, w)| x + w).unwrap();
        assert!(((end - LABEL_WIDTH) / PLOT_WIDTH - 120.0 / 150.0).abs() < 1e-4, "{end}");
        assert!(svg.contains(">150</text>") && !svg.contains(">200</text>"), "{svg}");
        assert!(svg.contains("rank 0: exec 97.00 ms"), "{svg}");
    }

    #[test]
    fn text_is_escaped_and_the_document_parses() {
        let svg = report().to_svg();
        let doc = roxmltree::Document::parse(&svg).expect("the SVG is well-formed XML");
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        assert_eq!(doc.root_element().tag_name().namespace(), Some("http://www.w3.org/2000/svg"));
        assert!(doc.descendants().any(|n| n.text() == Some("mode tile: a <reason> & \"quotes\"")), "{svg}");
        assert_eq!(doc.descendants().filter(|n| n.has_tag_name("g")).count(), 2);
    }

    #[test]
    fn ticks_are_round_numbers() {
        assert_eq!(tick_step(120.0), 50.0);
        assert_eq!(tick_step(9.0), 2.0);
        assert_eq!(tick_step(1000.0), 200.0);
        assert_eq!(tick_step(0.004), 0.001);
        assert_eq!([0.0, 50.0].map(|t| tick_label(t, 50.0)), ["0", "50"]);
        assert_eq!([0.0, 0.5].map(|t| tick_label(t, 0.5)), ["0.0", "0.5"]);
        // An empty or instant request still renders.
        let mut r = report();
        r.ranks.iter_mut().for_each(|r| r.phase_ms = PhaseMs::default());
        let svg = r.to_svg();
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        roxmltree::Document::parse(&svg).expect("well-formed");
        r.ranks.clear();
        roxmltree::Document::parse(&r.to_svg()).expect("well-formed");
    }
}
