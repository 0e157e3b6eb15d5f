//! The LTX decoders and encoders as the cost model sees them ([`vae_planner::cost`]): the whole
//! clip at once, in the order `networks.rs` runs its layers, with the maps each keeps alive.
//! Every convolution pads its input into a copy (frames repeated in time, zeros or a reflection
//! in H and W; a part's neighbours' rows fill its halo) and computes every tap. A resnet's
//! norm outputs live until their convolutions return, its input until the block's sum. The upsamples unfold a convolution's channels into 2 × 2 (× 2 frames, the
//! first dropped) blocks and add the input unfolded alike with its channels repeated; the
//! downsamples fold blocks into channels, the shortcut averaged.
//!
//! Requests whose frames are tiled in time (the framewise path) are not modelled: `auto` keeps
//! the family's rules for them.

use vae_planner::cost::{Network, NetworkBuilder};

use super::config::{LtxConfig, Stride};
use super::model::LtxVae;
use crate::family::{CostNetworks, Direction};

/// Every LTX convolution's kernel.
const K: [usize; 3] = [3, 3, 3];

/// `LTXVideoResnetBlock3d` with equal widths: norm (scaled and shifted when conditioned, the
/// same pass), SiLU, conv, twice, then the input added in place. A norm's output lives through
/// its convolution; the first convolution's output until the second norm is made.
fn resnet(b: &mut NetworkBuilder, align: usize) {
    let (c, x) = (b.channels(), b.map_elems());
    b.norm(false, 0);
    let n1 = b.map_elems();
    b.padded_conv(c, K, align, x + n1);
    b.norm(false, x);
    let n2 = b.map_elems();
    b.padded_conv(c, K, align, x + n2);
    b.add(x);
}

/// Frames after an upsample of `st` frames per frame, the first `st − 1` dropped.
fn up_frames(t: usize, st: usize) -> usize {
    (t * st).saturating_sub(st - 1)
}

/// `LTXVideoUpsampler3d`: the convolution to `cin · k / u` channels unfolded into `out = cin /
/// u` channels of `st × s × s` blocks; with `residual`, the input unfolded to `cin / k` channels,
/// repeated to `out`, added.
fn upsample(b: &mut NetworkBuilder, ([st, s, _], residual, u): (Stride, bool, usize), align: usize) {
    let (cin, dims, x) = (b.channels(), b.dims(), b.map_elems());
    let [t, h, w] = dims;
    let k = st * s * s;
    let out = cin / u;
    let up = [up_frames(t, st), s * h, s * w];
    b.padded_conv(cin * k / u, K, align, x);
    b.copy(out, up, x);
    if residual {
        let hx = b.map_elems();
        b.restart(cin, dims);
        b.copy(cin / k, up, hx);
        let unfolded = b.map_elems();
        if out > cin / k {
            b.copy(out, up, hx + unfolded);
        }
        let shortcut = b.map_elems();
        b.restart(out, up);
        b.add(shortcut);
    }
}

/// `LTXVideoDownsampler3d` to `out` channels: the first `st − 1` frames prepended (a copy where
/// `st > 1`), the shortcut folded and averaged, the convolution to `out / k` channels folded
/// alike, the two added. The caller holds the block's input throughout.
fn downsample(b: &mut NetworkBuilder, [st, s, _]: Stride, out: usize, align: usize) {
    let (c, [t, h, w]) = (b.channels(), b.dims());
    let k = st * s * s;
    let long = [t + st - 1, h, w];
    let down = [t.div_ceil(st), h / s, w / s];
    // `x`: the input besides the map the layer works on (`xl`, the longer copy or the input).
    let x = if st > 1 {
        let x = b.map_elems();
        b.copy(c, long, 0);
        x
    } else {
        0
    };
    let xl = b.map_elems();
    b.copy(out, down, x);
    let shortcut = b.map_elems();
    b.restart(c, long);
    b.padded_conv(out / k, K, align, x + xl + shortcut);
    b.copy(out, down, x + xl + shortcut);
    b.add(x + xl + shortcut);
}

/// The decoder over a `[frames, h, w]` latent (`LTXVideoDecoder3d` / `LTX2VideoDecoder3d`).
fn decoder(c: &LtxConfig, frames: usize, [h, w]: [usize; 2], elem: u64, batch: usize) -> Network {
    let mut b = NetworkBuilder::new(c.latent_channels, [frames, h, w], [h, w], elem, batch);
    let mut align = 1;
    b.padded_conv(c.decoder_stem, K, align, 0);
    for _ in 0..c.decoder_mid_layers {
        resnet(&mut b, align);
    }
    for level in &c.up {
        if let Some(up) = level.up {
            upsample(&mut b, up, align);
            align *= up.0[1];
        }
        for _ in 0..level.layers {
            resnet(&mut b, align);
        }
    }
    let p = c.patch_size;
    b.norm(false, 0);
    let n = b.map_elems();
    b.padded_conv(c.out_channels * p * p, K, align, n);
    let [t, h, w] = b.dims();
    b.copy(c.out_channels, [t, h * p, w * p], 0);
    b.finish()
}

/// The encoder over a `[frames, h, w]` video (`LTXVideoEncoder3d` / `LTX2VideoEncoder3d`): the
/// moments, the log-variance channel repeated.
fn encoder(c: &LtxConfig, frames: usize, [h, w]: [usize; 2], elem: u64, batch: usize) -> Network {
    let (p, factor) = (c.patch_size, c.encoder_spatial_factor());
    let mut b = NetworkBuilder::new(c.in_channels, [frames, h, w], [h / factor, w / factor], elem, batch);
    b.copy(c.in_channels * p * p, [frames, h / p, w / p], 0);
    let mut align = factor / p;
    b.padded_conv(c.encoder_stem, K, align, 0);
    for level in &c.down {
        for _ in 0..level.layers {
            resnet(&mut b, align);
        }
        if let Some(stride) = level.down {
            downsample(&mut b, stride, level.out, align);
            align /= stride[1];
        }
    }
    for _ in 0..c.encoder_mid_layers {
        resnet(&mut b, align);
    }
    b.norm(false, 0);
    let n = b.map_elems();
    b.padded_conv(c.latent_channels + 1, K, align, n);
    let (moments, dims) = (b.map_elems(), b.dims());
    b.copy(1, dims, moments);
    let logvar = b.map_elems();
    b.restart(c.latent_channels + 1, dims);
    b.copy(2 * c.latent_channels, dims, moments + logvar);
    b.finish()
}

impl LtxVae {
    /// The cost model's passes for a request on an `input_dims` input (`[B, C, T, H, W]`: a
    /// latent to decode or a video to encode): the whole input's, and each spatial tile's when
    /// it is larger than one tile. None for another shape, or frames tiled in time.
    pub fn cost_networks(&self, direction: Direction, input_dims: &[usize]) -> Option<CostNetworks> {
        let &[batch, _, frames, h, w] = input_dims else { return None };
        let c = self.config();
        let elem = self.dtype().size_in_bytes() as u64;
        let t = self.tiling();
        let pass = |[th, tw]: [usize; 2]| match direction {
            Direction::Decode => Some(decoder(c, frames, [th, tw], elem, batch)),
            Direction::Encode => Some(encoder(c, frames, [th, tw], elem, batch)),
        };
        let layout = match direction {
            Direction::Decode if t.tiles_frames_decode(frames) => return None,
            Direction::Encode if t.tiles_frames_encode(frames) => return None,
            Direction::Decode => t.spatial.needs_tiling_decode(h, w).ok()?.then(|| t.spatial.decode_layout(h, w)),
            Direction::Encode => t.spatial.needs_tiling_encode(h, w).then(|| {
                let r = self.encoder_spatial_factor();
                t.spatial.encode_layout_with_ratio(h, w, t.spatial.spatial_compression_ratio, |n| n / r)
            }),
        };
        CostNetworks::stitched([h, w], layout.transpose().ok()?, pass)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use vae_planner::cost::StepKind;

    use super::*;
    use crate::ltx::LtxClass;

    fn fixture(name: &str) -> LtxVae {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/ltx").join(name);
        let class = if name.starts_with("ltx2") { LtxClass::Ltx2 } else { LtxClass::LtxVideo };
        LtxVae::load_with(&dir, class, vae_tensor::Device::Cpu, vae_tensor::DType::F32).expect("the fixture loads")
    }

    /// Every LTX convolution pads a copy of its input and computes every tap.
    fn assert_padded(net: &Network) {
        let convs: Vec<_> = net.steps.iter().filter(|s| matches!(s.kind, StepKind::Conv { .. })).collect();
        assert!(!convs.is_empty());
        for s in convs {
            assert!(matches!(s.kind, StepKind::Conv { pads: true, overlapped: false, .. }), "{s:?}");
            assert_eq!(s.frame_taps, 3 * s.output[0]);
        }
    }

    /// A decode ends with the clip: 1 + (T − 1) × the temporal ratio frames of 3 channels at
    /// the spatial ratio; an encode with the moments, 2 × latent channels.
    #[test]
    fn decodes_end_with_the_clip_and_encodes_with_the_moments() {
        for name in ["ltx2_like", "ltx_video_like"] {
            let vae = fixture(name);
            let c = vae.config();
            let (s, ft) = (c.decoder_spatial_factor(), c.decoder_temporal_factor());
            let nets = vae.cost_networks(Direction::Decode, &[2, c.latent_channels, 3, 4, 6]).unwrap();
            let frames = 1 + 2 * ft;
            assert_eq!(nets.whole.output_elems, (3 * frames * 4 * s * 6 * s) as u64, "{name}");
            assert_eq!((nets.whole.batch, nets.whole.latent), (2, [4, 6]), "{name}");
            assert!(nets.tiles.is_empty());
            assert_padded(&nets.whole);

            let (s, ft) = (c.encoder_spatial_factor(), c.encoder_temporal_factor());
            let nets = vae.cost_networks(Direction::Encode, &[1, 3, 1 + ft, 2 * s, 3 * s]).unwrap();
            assert_eq!(nets.whole.output_elems, (2 * c.latent_channels * 2 * 2 * 3) as u64, "{name}");
            assert_eq!(nets.whole.latent, [2, 3]);
            assert_padded(&nets.whole);
            assert!(vae.cost_networks(Direction::Decode, &[1, 4, 4, 6]).is_none());
        }
    }

    /// A latent larger than one tile has a pass per tile, each of its tile's size.
    #[test]
    fn a_tiled_latent_has_a_pass_per_tile() {
        let vae = fixture("ltx2_like");
        let c = vae.config();
        let t = vae.tiling();
        let [th, tw] = [t.spatial.tile_sample_min_height, t.spatial.tile_sample_min_width];
        let s = c.decoder_spatial_factor();
        let (h, w) = (2 * th / s, 3 * tw / s);
        let nets = vae.cost_networks(Direction::Decode, &[1, c.latent_channels, 2, h, w]).unwrap();
        assert!(nets.tiles.len() >= 6, "{}", nets.tiles.len());
        assert!(nets.tiles.iter().all(|n| n.output_elems < nets.whole.output_elems));
    }
}
