//! The Wan2.1 / Qwen-Image / Wan2.2 decoder and encoder as the cost model sees them
//! ([`vae_planner::cost`]): one chunk at a time through the causal cache, in the order
//! `decoder.rs` and `encoder.rs` run their layers, with the maps each layer keeps alive.
//! Wan2.2's residual up blocks keep their input for the DupUp3D shortcut added after the
//! upsampler, and its output is unpatchified; its encoder patchifies the video first and its
//! residual down blocks add an AvgDown3D shortcut of their input.
//!
//! A decode is the first chunk (one frame at every level) followed by the others (frames
//! doubled by each temporal upsampler), so the pass is the chunks' steps one after another:
//! time adds up over them, and memory is the most any step holds, with the causal convs'
//! caches (each one's last two input frames) and the output frames decoded so far alive
//! beside it.

use vae_planner::cost::{Network, NetworkBuilder, StepKind};

use super::cache::CACHE_T;
use super::config::WanConfig;
use super::model::WanVae;
use crate::family::{CostNetworks, Direction};

/// One causal cache: its elements over the whole map, and those of one row across the width
/// and one column across the height (a part holds its halo's rows and columns besides its share).
#[derive(Debug, Clone, Copy, Default)]
struct Cache {
    elems: u64,
    edges: [u64; 2],
    frames: usize,
}

/// The walk over a decode: the builder, and the cache slots of the previous chunk and this one.
struct Walk {
    b: NetworkBuilder,
    /// Cache elements the previous chunk left, per slot in visit order, with their edges (one
    /// row's and one column's elements: a part's cache keeps its halo).
    previous: Vec<Cache>,
    /// Cache elements this chunk has written so far, per slot.
    current: Vec<Cache>,
    /// Caches alive now: the previous chunk's not yet replaced, and this chunk's.
    caches: u64,
    /// Their edges, likewise.
    edges: [u64; 2],
    /// Output elements decoded by the earlier chunks.
    decoded: u64,
    /// Whether this is the first chunk (its caches hold the one frame it has).
    first: bool,
    /// Elements of a residual up block's input, kept for its DupUp3D shortcut.
    shortcut: u64,
}

impl Walk {
    /// A fresh walk over a pass from `b`, before its first chunk.
    fn new(b: NetworkBuilder) -> Self {
        Self {
            b,
            previous: Vec::new(),
            current: Vec::new(),
            caches: 0,
            edges: [0, 0],
            decoded: 0,
            first: true,
            shortcut: 0,
        }
    }

    /// One chunk (`first` or not) through `steps`: its cache slots replace the previous
    /// chunk's, and its output joins what the earlier chunks produced.
    fn run_chunk(&mut self, first: bool, steps: impl FnOnce(&mut Self)) {
        self.first = first;
        self.current = Vec::new();
        steps(self);
        self.previous = std::mem::take(&mut self.current);
        self.decoded += self.b.map_elems();
    }

    /// After the last chunk: its caches are dropped; the chunks' outputs, `decoded` elements,
    /// stay.
    fn end_chunks(&mut self) {
        self.caches = 0;
        self.b.set_resident_edges([0, 0]);
    }

    /// Elements alive beside every step: the caches, the decoded output and a pending shortcut.
    fn carried(&self) -> u64 {
        self.caches + self.decoded + self.shortcut
    }

    /// A cache slot written: the previous chunk's entry gives way to this chunk's.
    fn write_cache(&mut self, cache: Cache) {
        let slot = self.current.len();
        let previous = self.previous.get(slot).copied().unwrap_or_default();
        self.caches = (self.caches + cache.elems).saturating_sub(previous.elems);
        self.edges = [0, 1].map(|i| (self.edges[i] + cache.edges[i]).saturating_sub(previous.edges[i]));
        self.b.set_resident_edges(self.edges);
        self.current.push(cache);
    }

    /// Frames the previous chunk left in the slot the next cached layer reads (none in the
    /// first chunk, or behind a slot the first chunk only marked).
    fn cached_frames(&self) -> usize {
        self.previous.get(self.current.len()).map_or(0, |c| c.frames)
    }

    /// The cache a layer keeps of its current input: its last frames (two after the first
    /// chunk), with a halo row (column) per neighbour where its kernel spans rows (`halo`).
    fn cache_of_input(&self, halo: bool) -> Cache {
        let [t, h, w] = self.b.dims();
        let frames = if self.first { t.min(CACHE_T) } else { CACHE_T };
        let c = (self.b.channels() * frames) as u64;
        let edges = if halo { [c * w as u64, c * h as u64] } else { [0, 0] };
        Cache { elems: c * (h * w) as u64, edges, frames }
    }

    /// A causal conv fed through the cache: behind the frames the previous chunk left in its
    /// slot (none in the first chunk, whose taps on the zero padding are skipped).
    fn cached_conv(&mut self, out: usize, kernel: [usize; 3], align: usize, resident: u64) {
        let cache = self.cache_of_input(kernel[1] > 1);
        let cached = self.cached_frames();
        self.b.causal_conv(out, kernel, align, cached, resident + self.carried());
        self.write_cache(cache);
    }

    /// `WanResidualBlock::forward`: every intermediate lives until the block returns.
    fn resnet(&mut self, out: usize, align: usize) {
        let cin = self.b.channels();
        let dims = self.b.dims();
        let x = self.b.map_elems();
        // The shortcut's map: the 1×1×1 conv's output, or a copy of the input (`x.clone()`).
        let shortcut;
        if cin != out {
            self.b.conv(out, [1, 1, 1], 1, self.carried());
            shortcut = self.b.map_elems();
            self.b.restart(cin, dims);
        } else {
            shortcut = x;
        }
        self.b.norm(false, shortcut + self.carried());
        let y1 = self.b.map_elems();
        self.cached_conv(out, [3, 3, 3], align, x + shortcut);
        let y2 = self.b.map_elems();
        self.b.norm(false, x + shortcut + y1 + self.carried());
        let y3 = self.b.map_elems();
        self.cached_conv(out, [3, 3, 3], align, x + shortcut + y1 + y2);
        self.b.add(x + shortcut + y1 + y2 + y3 + self.carried());
    }

    /// `Upsample::forward` at up block `i`: the time conv and the frames interleaved (temporal,
    /// after the first chunk), the frames laid out one by one, upsampled, the 3×3 conv (to half
    /// the channels, or as many for Wan2.2's residual blocks), and back to the video layout.
    fn upsample(&mut self, temporal: bool, align: usize, halve: bool) {
        let c = self.b.channels();
        // The caller's input and the copy the layer starts from (`x.clone()`), both alive
        // until it returns.
        let before = 2 * self.b.map_elems();
        if temporal {
            let cache = self.cache_of_input(false);
            let [t, h, w] = self.b.dims();
            if self.first {
                // The first chunk only marks the slot.
                self.write_cache(Cache::default());
            } else {
                // Behind the frames its slot holds: none in the second chunk (the first only
                // marked it), whose taps on the zero padding are skipped.
                let cached = self.cached_frames();
                self.b.causal_conv(2 * c, [3, 1, 1], 1, cached, self.carried());
                self.write_cache(cache);
                self.b.copy(c, [2 * t, h, w], before + self.carried());
            }
        }
        let dims = self.b.dims();
        self.b.copy(c, dims, before + self.carried());
        let frames = self.b.map_elems();
        self.b.upsample();
        let out = if halve { c / 2 } else { c };
        self.b.conv(out, [1, 3, 3], align, before + frames + self.carried());
        let up = self.b.dims();
        self.b.copy(out, up, before + frames + self.carried());
    }

    /// Wan2.2: `DupUp3D` of the block's input (a map of the upsampled size), added in place.
    fn dup_shortcut(&mut self) {
        let (channels, dims, x) = (self.b.channels(), self.b.dims(), self.b.map_elems());
        self.b.copy(channels, dims, x + self.carried());
        // The shortcut's input lives until the add is done.
        self.b.add(x + self.carried());
        self.shortcut = 0;
    }

    /// One chunk's steps from its latent frame.
    fn chunk(&mut self, c: &WanConfig) {
        let dim = c.decoder_base_dim.unwrap_or(c.base_dim);
        let last = *c.dim_mult.last().unwrap_or(&1);
        let dims: Vec<usize> = std::iter::once(last).chain(c.dim_mult.iter().rev().copied()).map(|u| dim * u).collect();
        let up_temporal: Vec<bool> = c.temperal_downsample.iter().rev().copied().collect();
        self.cached_conv(dims[0], [3, 3, 3], 1, 0);
        self.resnet(dims[0], 1);
        // Attention over each frame's positions, with a residual.
        let dims_now = self.b.dims();
        self.b.push(StepKind::Attention, dims[0], dims_now, self.carried());
        self.resnet(dims[0], 1);
        let mut align = 1;
        for i in 0..c.dim_mult.len() {
            let upsampled = i + 1 < c.dim_mult.len();
            if c.is_residual && upsampled {
                // `carry.shortcut = Some(x.clone())`: a copy of the block's input.
                let (channels, dims, x) = (self.b.channels(), self.b.dims(), self.b.map_elems());
                self.b.copy(channels, dims, x + self.carried());
                self.shortcut = x;
            }
            for _ in 0..=c.num_res_blocks {
                self.resnet(dims[i + 1], align);
            }
            if upsampled {
                align *= 2;
                self.upsample(*up_temporal.get(i).unwrap_or(&false), align, !c.is_residual);
                if c.is_residual {
                    self.dup_shortcut();
                }
            }
        }
        self.b.norm(false, self.carried());
        let normed = self.b.map_elems();
        self.cached_conv(c.out_channels, [3, 3, 3], align, normed);
    }

    /// `Downsample::forward` in the encoder: the frames laid out one by one, a stride-2 3×3
    /// convolution (after padding right and bottom; a band takes one row of the next), back
    /// to the video layout; for `downsample3d` after the first chunk (which only fills its
    /// cache with its frames), the stride-2 time convolution over the cached last frame and
    /// the chunk, caching the chunk's last frame.
    fn downsample(&mut self, temporal: bool) {
        let c = self.b.channels();
        let [t, h, w] = self.b.dims();
        let input = self.b.map_elems();
        self.b.copy(c, [t, h, w], input + self.carried());
        let frames = self.b.map_elems();
        let kind = StepKind::Conv { kernel: [1, 3, 3], align: 1, overlapped: false, pads: false };
        self.b.push(kind, c, [t, h / 2, w / 2], input + frames + self.carried());
        let half = self.b.map_elems();
        self.b.copy(c, [t, h / 2, w / 2], input + half + self.carried());
        if !temporal {
            return;
        }
        let [t, h, w] = self.b.dims();
        if self.first {
            self.write_cache(Cache { elems: self.b.map_elems(), edges: [0, 0], frames: t });
            return;
        }
        let x = self.b.map_elems();
        // `cat` of the cached frame and the chunk, then the time convolution (no padding).
        self.b.copy(c, [t + 1, h, w], x + self.carried());
        let kind = StepKind::Conv { kernel: [3, 1, 1], align: 1, overlapped: false, pads: false };
        self.b.push(kind, c, [(t + 1 - 3) / 2 + 1, h, w], x + self.carried());
        self.write_cache(Cache { elems: (c * h * w) as u64, edges: [0, 0], frames: 1 });
    }

    /// Wan2.2: the `AvgDown3D` shortcut of a residual down block's input (frames and pixels
    /// averaged by the block's factors into its output channels), kept until the block adds
    /// it, as is the input, which the caller holds until the block returns; the walk goes on
    /// from the block's copy of its input (`x.clone()`).
    fn avg_shortcut(&mut self, out: usize, factors: [usize; 2]) {
        let (channels, dims, x) = (self.b.channels(), self.b.dims(), self.b.map_elems());
        let [t, h, w] = dims;
        let shortcut = [t.div_ceil(factors[0]), h / factors[1], w / factors[1]];
        self.b.copy(out, shortcut, x + self.carried());
        self.shortcut = self.b.map_elems() + x;
        self.b.restart(channels, dims);
        self.b.copy(channels, dims, self.carried());
    }

    /// One chunk of frames through the encoder (`Encoder::forward`).
    fn encoder_chunk(&mut self, c: &WanConfig) {
        let levels = c.dim_mult.len();
        let dims: Vec<usize> = std::iter::once(1).chain(c.dim_mult.iter().copied()).map(|u| c.base_dim * u).collect();
        let mut align = 1usize << levels.saturating_sub(1);
        self.cached_conv(dims[0], [3, 3, 3], align, 0);
        for i in 0..levels {
            let out = dims[i + 1];
            let down = i + 1 < levels;
            let temporal = down && *c.temperal_downsample.get(i).unwrap_or(&false);
            if c.is_residual {
                self.avg_shortcut(out, [if temporal { 2 } else { 1 }, if down { 2 } else { 1 }]);
            }
            for _ in 0..c.num_res_blocks {
                self.resnet(out, align);
            }
            if down {
                align = (align / 2).max(1);
                self.downsample(temporal);
            }
            if c.is_residual {
                let resident = self.carried();
                self.shortcut = 0;
                self.b.add(resident);
            }
        }
        let top = *dims.last().unwrap_or(&0);
        self.resnet(top, 1);
        let dims_now = self.b.dims();
        self.b.push(StepKind::Attention, top, dims_now, self.carried());
        self.resnet(top, 1);
        self.b.norm(false, self.carried());
        let normed = self.b.map_elems();
        self.cached_conv(2 * c.z_dim, [3, 3, 3], 1, normed);
    }
}

/// The encoder over a `frames × [h, w]` video (1 + 4k frames; Wan2.2's patchified first), in
/// chunks of 1 and then 4 frames, each chunk's frames copied out of the video; the chunks'
/// moments concatenated, then `quant_conv` and the mean.
fn encoder(c: &WanConfig, frames: usize, [h, w]: [usize; 2], elem: u64, batch: usize) -> Network {
    let patch = c.patch_size.filter(|&p| p > 1).unwrap_or(1);
    let scale = (1usize << c.dim_mult.len().saturating_sub(1)) * patch;
    let rgb = c.in_channels / (patch * patch);
    let mut walk = Walk::new(NetworkBuilder::new(rgb, [frames, h, w], [h / scale, w / scale], elem, batch));
    let (hp, wp) = (h / patch, w / patch);
    if patch > 1 {
        walk.b.copy(c.in_channels, [frames, hp, wp], 0);
    }
    let video = walk.b.map_elems();
    let chunks = 1 + frames.saturating_sub(1) / 4;
    for i in 0..chunks {
        walk.run_chunk(i == 0, |walk| {
            let len = if i == 0 { 1 } else { 4 };
            walk.b.restart(c.in_channels, [frames, hp, wp]);
            walk.b.copy(c.in_channels, [len, hp, wp], video + walk.carried());
            walk.encoder_chunk(c);
        });
    }
    let [_, hl, wl] = walk.b.dims();
    let moments = walk.decoded;
    walk.end_chunks();
    walk.b.restart(2 * c.z_dim, [chunks, hl, wl]);
    // `Tensor::cat` of the chunks' moments, `quant_conv`, then the mean's channels.
    walk.b.copy(2 * c.z_dim, [chunks, hl, wl], moments);
    walk.b.conv(2 * c.z_dim, [1, 1, 1], 1, 0);
    walk.b.copy(c.z_dim, [chunks, hl, wl], 0);
    walk.b.finish()
}

/// The decoder over `frames` latent frames of `[h, w]` (after `post_quant_conv`), then the
/// chunks' outputs concatenated, unpatchified (Wan2.2) and clamped.
fn decoder(c: &WanConfig, frames: usize, [h, w]: [usize; 2], elem: u64, batch: usize) -> Network {
    let mut walk = Walk::new(NetworkBuilder::new(c.z_dim, [frames, h, w], [h, w], elem, batch));
    walk.b.conv(c.z_dim, [1, 1, 1], 1, 0);
    for i in 0..frames {
        walk.run_chunk(i == 0, |walk| {
            walk.b.restart(c.z_dim, [1, h, w]);
            walk.chunk(c);
        });
    }
    // `Tensor::cat` of the chunks, then the clamp.
    let [_, ho, wo] = walk.b.dims();
    let total = walk.decoded;
    let out_frames = (total / (c.out_channels * ho * wo).max(1) as u64) as usize;
    walk.end_chunks();
    walk.b.copy(c.out_channels, [out_frames, ho, wo], total);
    let (mut channels, mut dims) = (c.out_channels, [out_frames, ho, wo]);
    if let Some(p) = c.patch_size.filter(|&p| p > 1) {
        // `unpatchify`: channels into p × p pixel blocks, a new map.
        (channels, dims) = (c.out_channels / (p * p), [out_frames, ho * p, wo * p]);
        walk.b.copy(channels, dims, 0);
    }
    walk.b.copy(channels, dims, 0);
    walk.b.finish()
}

impl WanVae {
    /// The cost model's passes for a request on an `input_dims` input (`[B, C, T, H, W]`: a
    /// latent to decode or a video to encode): the whole input's, and each tile's when it is
    /// larger than one tile. None for another shape.
    pub fn cost_networks(&self, direction: Direction, input_dims: &[usize]) -> Option<CostNetworks> {
        let &[batch, _, frames, h, w] = input_dims else { return None };
        let c = self.config();
        let elem = self.dtype().size_in_bytes() as u64;
        let tiling = self.tiling();
        // An encode's tiles are cut in the patchified pixels; a pass takes the pixels.
        let patch = self.patch();
        let pass = |[th, tw]: [usize; 2]| match direction {
            Direction::Decode => Some(decoder(c, frames, [th, tw], elem, batch)),
            Direction::Encode => Some(encoder(c, frames, [th * patch, tw * patch], elem, batch)),
        };
        let (extent, layout) = match direction {
            Direction::Decode => {
                let tiled = tiling.needs_tiling_decode(h, w).ok()?;
                ([h, w], if tiled { Some(tiling.decode_layout(h, w).ok()?) } else { None })
            }
            Direction::Encode => {
                let (hp, wp) = (h / patch, w / patch);
                let halvings = c.dim_mult.len().saturating_sub(1);
                let tiled = tiling.needs_tiling_encode(hp, wp);
                ([hp, wp], if tiled { Some(tiling.encode_layout(hp, wp, |n| n >> halvings).ok()?) } else { None })
            }
        };
        CostNetworks::stitched(extent, layout, pass)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn fixture_named(name: &str) -> WanVae {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/wan").join(name);
        WanVae::load(&dir).expect("the fixture loads")
    }

    fn fixture() -> WanVae {
        fixture_named("wan21_like")
    }

    /// A steady chunk (a latent frame after the first) costs the multiply-adds the pipeline's
    /// stage balancing counts for it, layer by layer from the weights: Wan2.1 and Wan2.2 (its
    /// residual up blocks and upsamplers that keep the channels).
    #[test]
    fn a_chunk_costs_what_the_decoders_own_count_says() {
        for (vae, z) in [(fixture(), 16), (fixture_named("wan22_like"), 48)] {
            let (h, w) = (6, 10);
            let macs = |frames| vae.cost_networks(Direction::Decode, &[1, z, frames, h, w]).unwrap().whole.macs();
            let steady = macs(3) - macs(2);
            let counted: u64 = vae.decoder.step_costs(h, w).iter().sum();
            // The walk also counts post_quant_conv (z_dim² per latent pixel) per latent frame.
            let post_quant = (z * z * h * w) as u64;
            assert_eq!(steady, counted + post_quant, "z_dim {z}");
        }
    }

    /// Wan2.2's output is unpatchified: 3 channels at twice the decoder's last resolution.
    #[test]
    fn a_wan22_decode_ends_with_the_unpatchified_video() {
        let vae = fixture_named("wan22_like");
        let nets = vae.cost_networks(Direction::Decode, &[1, 48, 2, 4, 6]).unwrap();
        // 1 + 4 frames at 16× the latent.
        assert_eq!(nets.whole.output_elems, 3 * 5 * 64 * 96);
        let last = nets.whole.steps.last().unwrap();
        assert_eq!((last.out_channels, last.output), (3, [5, 64, 96]));
    }

    /// The first latent frame has no cache: its causal convolutions' taps on the zero frames
    /// in front are skipped (one of three), and the second frame's first output frame reads one
    /// cached frame (two of three). Its caches hold a halo row per neighbour of a band.
    #[test]
    fn the_first_frames_skip_the_padding_taps_and_caches_keep_their_edges() {
        let vae = fixture();
        let (h, w) = (6, 10);
        let macs = |frames| vae.cost_networks(Direction::Decode, &[1, 16, frames, h, w]).unwrap().whole;
        let one = macs(1);
        let conv_in = one.steps.iter().find(|s| s.kind.label(true).starts_with("conv 3x3x3")).unwrap();
        assert_eq!(conv_in.frame_taps, 1);
        assert_eq!(conv_in.macs(), (h * w * 16 * conv_in.out_channels * 9) as u64);
        let two = macs(2);
        let taps: Vec<usize> = two
            .steps
            .iter()
            .filter(|s| s.kind.label(true).starts_with("conv 3x3x3") && s.input[0] == 4)
            .map(|s| s.frame_taps)
            .collect();
        // The second chunk's last stage: four output frames behind one cached frame.
        assert!(!taps.is_empty() && taps.iter().all(|&t| t == 2 + 3 * 3), "{taps:?}");
        // Once a cache is written, the steps after it count its edges.
        assert!(two.steps.iter().any(|s| s.resident_edges[0] > 0 && s.resident_edges[1] > 0));
        assert_eq!(two.steps.last().unwrap().resident_edges, [0, 0]);
    }

    #[test]
    fn the_decode_ends_with_the_whole_video() {
        let vae = fixture();
        let nets = vae.cost_networks(Direction::Decode, &[2, 16, 3, 4, 6]).unwrap();
        // 1 + 2 × 4 frames of 3 channels at 8× the latent, batch 2.
        assert_eq!(nets.whole.output_elems, 3 * 9 * 32 * 48);
        assert_eq!(nets.whole.batch, 2);
        assert!(nets.tiles.is_empty());
        assert!(vae.cost_networks(Direction::Decode, &[1, 16, 4, 6]).is_none());
        assert!(vae.cost_networks(Direction::Encode, &[1, 3, 32, 48]).is_none());
    }

    /// An encode ends with the latent mean: one latent frame per chunk (1, then 4 frames) at an
    /// eighth of the pixels, a sixteenth for Wan2.2 (its video patchified first, 2 × 2 pixels
    /// into 12 channels); its shard cuts latent rows.
    #[test]
    fn an_encode_ends_with_the_latent_mean() {
        for (vae, z, scale) in [(fixture(), 16, 8), (fixture_named("wan22_like"), 48, 16)] {
            let nets = vae.cost_networks(Direction::Encode, &[1, 3, 9, 64, 96]).unwrap();
            let whole = &nets.whole;
            assert_eq!(whole.output_elems, (z * 3 * (64 / scale) * (96 / scale)) as u64, "z_dim {z}");
            assert_eq!(whole.input_elems, 3 * 9 * 64 * 96);
            assert_eq!(whole.latent, [64 / scale, 96 / scale]);
            assert_eq!(whole.steps[0].out_channels, if scale == 16 { 12 } else { 3 });
        }
    }

    /// The time downsampling: the first chunk only fills its cache (its frame stays one),
    /// a later chunk's four frames are halved twice by stride-2 time convolutions reading the
    /// cached frame, without padding taps; the first chunk's causal convolutions skip theirs.
    #[test]
    fn an_encode_halves_time_after_the_first_chunk() {
        let vae = fixture();
        let nets = vae.cost_networks(Direction::Encode, &[1, 3, 5, 32, 48]).unwrap();
        let time_convs: Vec<_> =
            nets.whole.steps.iter().filter(|s| s.kind.label(true).starts_with("conv 3x1x1")).collect();
        assert_eq!(time_convs.iter().map(|s| (s.input[0], s.output[0])).collect::<Vec<_>>(), [(5, 2), (3, 1)]);
        assert!(time_convs.iter().all(|s| s.frame_taps == 3 * s.output[0]));
        let conv_in = nets.whole.steps.iter().find(|s| s.kind.label(true).starts_with("conv 3x3x3")).unwrap();
        assert_eq!((conv_in.input[0], conv_in.frame_taps), (1, 1));
        // The strided spatial convolutions halve the map three times per chunk.
        let strided =
            nets.whole.steps.iter().filter(|s| s.output[1] * 2 == s.input[1] && s.output[2] * 2 == s.input[2]);
        assert_eq!(strided.count(), 2 * 3);
    }

    /// A video larger than a tile has a pass per tile of its (patchified) pixels.
    #[test]
    fn a_tiled_encode_has_a_pass_per_tile() {
        let mut vae = fixture();
        vae.set_tiling([16, 24], [8, 16]).unwrap();
        let nets = vae.cost_networks(Direction::Encode, &[1, 3, 5, 64, 96]).unwrap();
        let layout = vae.tiling().encode_layout(64, 96, |n| n >> 3).unwrap();
        assert!(vae.tiling().needs_tiling_encode(64, 96));
        assert_eq!(nets.tiles.len(), layout.tiles().count());
        assert!(nets.tiles.iter().all(|t| t.input_elems < nets.whole.input_elems));
    }
}
