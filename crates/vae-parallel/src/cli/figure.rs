//! The demo's figure (SVG): one decoded picture cut the three ways the ranks can share it, the
//! tile mode's overlapping tiles (blended where they overlap), a spatial shard's bands and a 2-D
//! shard's blocks (every convolution exchanging halos with the neighbours), each piece in the
//! colour of the rank that computed it; below, every rank's timeline of the 2-D decode. Drawn by
//! the tool from the requests' own reports, as `vae-parallel demo --svg FILE` writes it; plain
//! SVG 1.1 with the picture inlined, so any browser or viewer shows it on its own.

use std::fmt::Write as _;

use crate::planner::TileLayout2d;
use crate::report::RequestReport;
use crate::{Tensor, io};

/// Rank colours (Tableau 10), cycled past ten ranks.
const COLOURS: [&str; 10] =
    ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
/// The figure's width: the rank timeline's.
const WIDTH: f64 = 1050.0;
/// Space between panels, and above them for their titles.
const GAP: f64 = 60.0;
const TITLE: f64 = 56.0;

fn colour(rank: usize) -> &'static str {
    COLOURS[rank % COLOURS.len()]
}

/// A rectangle `[rows, columns]` in latent units, drawn `scale` pixels per unit at `(x, y)`.
fn rect(svg: &mut String, at: (f64, f64), scale: f64, rows: [usize; 2], cols: [usize; 2], rank: usize, what: &str) {
    let (x, y) = (at.0 + cols[0] as f64 * scale, at.1 + rows[0] as f64 * scale);
    let (w, h) = ((cols[1] - cols[0]) as f64 * scale, (rows[1] - rows[0]) as f64 * scale);
    let _ = writeln!(
        svg,
        r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{0}" fill-opacity="0.22" stroke="{0}" stroke-width="2"><title>rank {rank}: {what}</title></rect>"#,
        colour(rank)
    );
}

/// The figure for the demo's decodes: `reports` are the tile, height-band and 2-D requests, in
/// that order; `image` the untiled decode `[1, 3, H, W]`; `layout` the tiles of the tile mode
/// (latent units), when the family has them.
pub fn figure(image: &Tensor, layout: Option<&TileLayout2d>, reports: &[&RequestReport]) -> anyhow::Result<String> {
    let [tiles, bands, blocks] = reports else { anyhow::bail!("the figure draws three requests") };
    let (h, w) = (image.dims()[2], image.dims()[3]);
    let latent_h = bands.ranks.iter().filter_map(|r| r.band).map(|b| b[1]).max().unwrap_or(h);
    let scale = h as f64 / latent_h.max(1) as f64;
    let side = 256.0_f64.max(w as f64);
    let zoom = side / w as f64;
    let left = (WIDTH - 3.0 * side - 2.0 * GAP) / 2.0;
    let png = io::png_bytes(&image.narrow(0, 0, 1)?.reshape(vec![3, h, w])?)?;

    let mut body = String::new();
    let _ = writeln!(
        body,
        r#"<defs><image id="picture" width="{:.1}" height="{:.1}" preserveAspectRatio="none" xlink:href="data:image/png;base64,{}"/></defs>"#,
        w as f64 * zoom,
        h as f64 * zoom,
        base64(&png)
    );
    let titles = [
        (format!("tile mode: {} tiles", tiles.tile_count), "overlaps blended as diffusers blends them"),
        (format!("{}: {} bands", bands.strategy, bands.ranks.len()), "halo rows exchanged at every convolution"),
        (format!("{}: blocks", blocks.strategy), "halos along both axes, corners included"),
    ];
    for (i, (title, note)) in titles.iter().enumerate() {
        let x = left + i as f64 * (side + GAP);
        let _ = writeln!(body, r#"<text x="{x:.1}" y="22" font-size="14" font-weight="bold">{title}</text>"#);
        let _ = writeln!(body, r##"<text x="{x:.1}" y="40" fill="#555555">{note}</text>"##);
        let _ = writeln!(body, r##"<use xlink:href="#picture" x="{x:.1}" y="{TITLE}"/>"##);
    }
    let at = |i: usize| (left + i as f64 * (side + GAP), TITLE);
    let px = scale * zoom;
    if let Some(layout) = layout {
        for tile in layout.tiles() {
            let rank = tiles.ranks.iter().find(|r| r.tiles.contains(&tile.tile_id)).map_or(0, |r| r.rank);
            let [rows, cols] = &tile.input;
            let what = format!("tile {}", tile.tile_id);
            rect(&mut body, at(0), px, [rows.start, rows.end], [cols.start, cols.end], rank, &what);
        }
    }
    for r in &bands.ranks {
        if let Some(band) = r.band {
            let latent_w = (w as f64 / scale).round() as usize;
            rect(&mut body, at(1), px, band, [0, latent_w], r.rank, &format!("latent rows {}..{}", band[0], band[1]));
        }
    }
    for r in &blocks.ranks {
        if let Some([rows, cols]) = r.block {
            let what = format!("latent rows {}..{}, columns {}..{}", rows[0], rows[1], cols[0], cols[1]);
            rect(&mut body, at(2), px, rows, cols, r.rank, &what);
        }
    }
    let legend_y = TITLE + h as f64 * zoom + 24.0;
    for rank in 0..blocks.world_size {
        let x = left + rank as f64 * 80.0;
        let _ = writeln!(
            body,
            r#"<rect x="{x:.1}" y="{:.1}" width="14" height="14" fill="{}"/><text x="{:.1}" y="{:.1}">rank {rank}</text>"#,
            legend_y - 11.0,
            colour(rank),
            x + 20.0,
            legend_y + 1.0
        );
    }

    // The 2-D decode's rank timeline, the report's own plot, below.
    let timeline = blocks.to_svg();
    let timeline_height = attribute(&timeline, "height").unwrap_or(200.0);
    let top = legend_y + 20.0;
    let nested =
        timeline.replacen("<svg xmlns=\"http://www.w3.org/2000/svg\"", &format!("<svg x=\"0\" y=\"{top:.1}\""), 1);
    let height = top + timeline_height;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    svg.push_str(&body);
    svg.push_str(&nested);
    svg.push_str("</svg>\n");
    Ok(svg)
}

/// The numeric value of the first `name="…"` attribute of an SVG document.
fn attribute(svg: &str, name: &str) -> Option<f64> {
    let start = svg.find(&format!("{name}=\""))? + name.len() + 2;
    svg[start..].split('"').next()?.parse().ok()
}

/// Standard base64 (RFC 4648, padded).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::base64;

    #[test]
    fn base64_is_rfc_4648() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }
}
