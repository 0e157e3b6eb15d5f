//! The HunyuanVideo-1.5 decoder and encoder as the cost model sees them
//! ([`vae_planner::cost`]): the whole clip at once (the attention looks at every earlier frame,
//! so it is not run a frame at a time), in the order `networks.rs` runs its layers, with the maps
//! each keeps alive. Every causal convolution pads its input into a copy (the frames in front and
//! the edges replicated; a part's neighbours' rows fill its halo) and computes every tap, the
//! replicated frames being data. The upsamples unfold a convolution's channels into 2 × 2
//! pixels (× 2 frames after the first when temporal) and add the input's channels repeated
//! and unfolded alike; the downsamples fold 2 × 2 pixels (× 2 frames after the first) into a
//! convolution's channels and add the input folded alike with its channel groups averaged.

use vae_planner::cost::{Network, NetworkBuilder, StepKind};

use super::config::HunyuanVideo15Config;
use super::model::HunyuanVideo15Vae;
use crate::family::{CostNetworks, Direction};

/// `HunyuanVideo15ResnetBlock`: norm, SiLU, conv, twice, plus the input (through a 1 × 1 × 1
/// convolution where the width changes); the caller holds the input until it returns, and a
/// norm's output lives through its convolution.
fn resnet(b: &mut NetworkBuilder, out: usize, align: usize) {
    let (cin, dims, x) = (b.channels(), b.dims(), b.map_elems());
    b.norm(false, 0);
    let n1 = b.map_elems();
    b.padded_conv(out, [3, 3, 3], align, x + n1);
    b.norm(false, x);
    let n2 = b.map_elems();
    b.padded_conv(out, [3, 3, 3], align, x + n2);
    let y = b.map_elems();
    if cin != out {
        b.restart(cin, dims);
        b.conv(out, [1, 1, 1], 1, y);
    }
    b.add(x + y);
}

/// `HunyuanVideo15Upsample` to `out` channels: the convolution to `factor · out` channels,
/// unfolded into 2 × 2 pixels (× 2 frames after the first when temporal), and the input's
/// channels repeated to as many and unfolded likewise, added.
fn upsample(b: &mut NetworkBuilder, out: usize, temporal: bool, align: usize) {
    let (cin, dims, x) = (b.channels(), b.dims(), b.map_elems());
    let [t, h, w] = dims;
    let factor = if temporal { 8 } else { 4 };
    b.padded_conv(factor * out, [3, 3, 3], align, x);
    let up = [if temporal { 1 + 2 * t.saturating_sub(1) } else { t }, 2 * h, 2 * w];
    b.copy(out, up, x);
    let unfolded = b.map_elems();
    b.restart(cin, dims);
    b.copy(factor * out, dims, unfolded);
    b.copy(out, up, x + unfolded);
    b.add(x + unfolded);
}

/// The decoder over a `[frames, h, w]` latent (`HunyuanVideo15Decoder3D`); no clamp.
fn decoder(c: &HunyuanVideo15Config, frames: usize, [h, w]: [usize; 2], elem: u64, batch: usize) -> Option<Network> {
    let widths: Vec<usize> = c.block_out_channels.iter().rev().copied().collect();
    let top = *widths.first()?;
    let mut b = NetworkBuilder::new(c.latent_channels, [frames, h, w], [h, w], elem, batch);
    b.padded_conv(top, [3, 3, 3], 1, 0);
    let x = b.map_elems();
    // The latent's channels repeated to the width, added.
    b.restart(c.latent_channels, [frames, h, w]);
    b.copy(top, [frames, h, w], x);
    b.add(x);
    resnet(&mut b, top, 1);
    let dims = b.dims();
    b.push(StepKind::Attention, top, dims, 0);
    resnet(&mut b, top, 1);
    let mut align = 1;
    for (i, level) in c.decoder_levels().ok()?.into_iter().enumerate() {
        for _ in 0..=c.layers_per_block {
            resnet(&mut b, widths[i], align);
        }
        if let Some(r) = level {
            upsample(&mut b, r.out_channels, r.temporal, align);
            align *= 2;
        }
    }
    b.norm(false, 0);
    b.padded_conv(c.out_channels, [3, 3, 3], align, 0);
    Some(b.finish())
}

/// `HunyuanVideo15Downsample` to `out` channels: the convolution to `out / factor` channels,
/// folded (the first frame alone, doubled in channels, when temporal), and the input folded
/// alike with its channel groups averaged to `out`, added.
fn downsample(b: &mut NetworkBuilder, out: usize, temporal: bool, align: usize) {
    let (cin, dims, x) = (b.channels(), b.dims(), b.map_elems());
    let [t, h, w] = dims;
    let factor = if temporal { 8 } else { 4 };
    let down = [if temporal { 1 + t.saturating_sub(1) / 2 } else { t }, h / 2, w / 2];
    b.padded_conv(out / factor, [3, 3, 3], align, x);
    let y = b.map_elems();
    if temporal {
        // The frames after the first, apart, before they fold; the two halves joined.
        b.copy(out / factor, [t.saturating_sub(1), h, w], x + y);
        b.copy(out, down, x + y);
    }
    b.copy(out, down, x + y);
    let folded = b.map_elems();
    b.restart(cin, dims);
    b.copy(cin * factor, [down[0], h / 2, w / 2], folded);
    let x_folded = b.map_elems();
    b.copy(out, down, folded + x_folded);
    b.add(folded);
}

/// The encoder over a `[frames, h, w]` video (`HunyuanVideo15Encoder3D`): the moments, plus
/// the last map's channel groups averaged.
fn encoder(c: &HunyuanVideo15Config, frames: usize, [h, w]: [usize; 2], elem: u64, batch: usize) -> Option<Network> {
    let widths = &c.block_out_channels;
    let ratio = c.spatial_compression_ratio.max(1);
    let mut b = NetworkBuilder::new(c.in_channels, [frames, h, w], [h / ratio, w / ratio], elem, batch);
    let mut align = ratio;
    b.padded_conv(*widths.first()?, [3, 3, 3], align, 0);
    for (i, level) in c.encoder_levels().ok()?.into_iter().enumerate() {
        for _ in 0..c.layers_per_block {
            resnet(&mut b, widths[i], align);
        }
        if let Some(r) = level {
            downsample(&mut b, r.out_channels, r.temporal, align);
            align /= 2;
        }
    }
    let last = b.channels();
    resnet(&mut b, last, 1);
    let dims = b.dims();
    b.push(StepKind::Attention, last, dims, 0);
    resnet(&mut b, last, 1);
    let x = b.map_elems();
    let moments = 2 * c.latent_channels;
    b.copy(moments, dims, 0);
    let shortcut = b.map_elems();
    b.restart(last, dims);
    b.norm(false, shortcut);
    let n = b.map_elems();
    b.padded_conv(moments, [3, 3, 3], 1, x + shortcut + n);
    b.add(x + shortcut);
    Some(b.finish())
}

impl HunyuanVideo15Vae {
    /// The cost model's passes for a request on an `input_dims` input (`[B, C, T, H, W]`: a
    /// latent to decode or a video to encode): the whole input's, and each tile's when it is
    /// larger than one tile. None for another shape.
    pub fn cost_networks(&self, direction: Direction, input_dims: &[usize]) -> Option<CostNetworks> {
        let &[batch, _, frames, h, w] = input_dims else { return None };
        let c = self.config();
        let elem = self.dtype().size_in_bytes() as u64;
        let t = self.tiling();
        let pass = |[th, tw]: [usize; 2]| match direction {
            Direction::Decode => decoder(c, frames, [th, tw], elem, batch),
            Direction::Encode => encoder(c, frames, [th, tw], elem, batch),
        };
        let layout = match direction {
            Direction::Decode => t.needs_tiling_decode(h, w).then(|| t.decode_layout(h, w, self.spatial_ratio())),
            Direction::Encode => t.needs_tiling_encode(h, w).then(|| t.encode_layout(h, w, self.spatial_ratio())),
        };
        CostNetworks::stitched([h, w], layout.transpose().ok()?, pass)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn fixture() -> HunyuanVideo15Vae {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hunyuan_video15/hunyuan_video15_like");
        HunyuanVideo15Vae::load_with(&dir, vae_tensor::Device::Cpu, vae_tensor::DType::F32).expect("the fixture loads")
    }

    /// A decode ends with the clip: 1 + 4 (T − 1) frames of 3 channels at 8× the latent;
    /// every 3×3×3 convolution pads a copy of its input and computes every tap.
    #[test]
    fn a_decode_ends_with_the_clip_and_its_convolutions_pad() {
        let vae = fixture();
        let nets = vae.cost_networks(Direction::Decode, &[2, 4, 3, 4, 6]).unwrap();
        assert_eq!(nets.whole.output_elems, 3 * 9 * 32 * 48);
        assert_eq!(nets.whole.batch, 2);
        assert!(nets.tiles.is_empty());
        let convs: Vec<_> = nets.whole.steps.iter().filter(|s| s.kind.label(true).starts_with("conv 3x3x3")).collect();
        assert!(!convs.is_empty());
        for s in convs {
            assert!(matches!(s.kind, StepKind::Conv { pads: true, overlapped: false, .. }), "{s:?}");
            assert_eq!(s.frame_taps, 3 * s.output[0]);
        }
        assert!(vae.cost_networks(Direction::Decode, &[1, 4, 4, 6]).is_none());
    }

    /// An encode ends with the moments: 2 × latent channels of 1 + (F − 1) / 4 frames at the
    /// latent's size; its convolutions pad too.
    #[test]
    fn an_encode_ends_with_the_moments() {
        let vae = fixture();
        let c = vae.config();
        let s = c.spatial_compression_ratio;
        let nets = vae.cost_networks(Direction::Encode, &[1, 3, 5, 2 * s, 3 * s]).unwrap();
        let frames = 1 + 4 / c.temporal_compression_ratio;
        assert_eq!(nets.whole.output_elems, (2 * c.latent_channels * frames * 2 * 3) as u64);
        assert_eq!(nets.whole.latent, [2, 3]);
        assert!(nets.tiles.is_empty());
        assert!(nets.whole.steps.iter().any(|s| s.kind == StepKind::Attention));
        for s in nets.whole.steps.iter().filter(|s| s.kind.label(true).starts_with("conv 3x3x3")) {
            assert!(matches!(s.kind, StepKind::Conv { pads: true, overlapped: false, .. }), "{s:?}");
        }
    }
}
