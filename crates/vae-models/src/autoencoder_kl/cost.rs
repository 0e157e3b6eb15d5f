//! The AutoencoderKL encoder and decoder as the cost model sees them ([`vae_planner::cost`]):
//! their steps in the order `model.rs` runs them, with the maps each keeps alive.

use vae_planner::cost::{Network, NetworkBuilder, StepKind};

use super::config::AutoencoderKlConfig;
use super::model::AutoencoderKl;
use crate::family::{CostNetworks, Direction};

/// `ResnetBlock2d::forward_on`: its input stays alive throughout (the residual), beside one
/// normalised map, its padded copy and the convolution's output.
fn resnet(b: &mut NetworkBuilder, out_channels: usize, align: usize) {
    let x = b.map_elems();
    let cin = b.channels();
    b.norm(true, 0).conv(out_channels, [1, 3, 3], align, x);
    b.norm(true, x).conv(out_channels, [1, 3, 3], align, x);
    let h = b.map_elems();
    if cin != out_channels {
        // The 1×1 shortcut reads the block's input into a new map while `h` waits, then `h`
        // is added to it.
        let dims = b.dims();
        b.push_from(
            cin,
            StepKind::Conv { kernel: [1, 1, 1], align: 1, overlapped: false, pads: false },
            out_channels,
            dims,
            h,
        )
        .add(x + h);
    } else {
        b.add(x);
    }
}

/// `MidBlock2d`: resnet, attention (when configured), resnet.
fn mid_block(b: &mut NetworkBuilder, c: &AutoencoderKlConfig, channels: usize) {
    resnet(b, channels, 1);
    if c.mid_block_add_attention {
        b.attention();
    }
    resnet(b, channels, 1);
}

/// The decoder (after `post_quant_conv`) on a `[h, w]` latent.
fn decoder(c: &AutoencoderKlConfig, [h, w]: [usize; 2], elem: u64, batch: usize) -> Network {
    let mut b = NetworkBuilder::new(c.latent_channels, [1, h, w], [h, w], elem, batch);
    if c.use_post_quant_conv {
        b.conv(c.latent_channels, [1, 1, 1], 1, 0);
    }
    let widths = &c.decoder_block_out_channels;
    let top = *widths.last().unwrap_or(&0);
    b.conv(top, [1, 3, 3], 1, 0);
    mid_block(&mut b, c, top);
    // Rows one latent row spans at each level, as `Decoder::load` aligns its convolutions.
    let mut align = 1;
    for (i, &width) in widths.iter().rev().enumerate() {
        for _ in 0..=c.layers_per_block {
            resnet(&mut b, width, align);
        }
        if i + 1 < widths.len() {
            align *= 2;
            // Upsample2d: the nearest 2× map, then its convolution (the block's input alive).
            let before = b.map_elems();
            b.upsample().conv(width, [1, 3, 3], align, before);
        }
    }
    b.norm(true, 0).conv(c.out_channels, [1, 3, 3], align, 0);
    b.finish()
}

/// The encoder (then `quant_conv`) on an `[h, w]` image cut in latent rows of `scale` pixels.
fn encoder(c: &AutoencoderKlConfig, [h, w]: [usize; 2], elem: u64, batch: usize) -> Network {
    let scale = c.spatial_scale().max(1);
    let mut b = NetworkBuilder::new(c.in_channels, [1, h, w], [h / scale, w / scale], elem, batch);
    let widths = &c.block_out_channels;
    // Rows one latent row spans at each level, as `Encoder::load` aligns its convolutions.
    let mut align = 1usize << (widths.len().saturating_sub(1));
    b.conv(widths[0], [1, 3, 3], align, 0);
    for (i, &width) in widths.iter().enumerate() {
        for _ in 0..c.layers_per_block {
            resnet(&mut b, width, align);
        }
        if i + 1 < widths.len() {
            b.downsample(width);
        }
        align = (align / 2).max(1);
    }
    let top = *widths.last().unwrap_or(&0);
    mid_block(&mut b, c, top);
    b.norm(true, 0).conv(2 * c.latent_channels, [1, 3, 3], 1, 0);
    if c.use_quant_conv {
        b.conv(2 * c.latent_channels, [1, 1, 1], 1, 0);
    }
    b.finish()
}

impl AutoencoderKl {
    /// The cost model's passes for a request on an `input_dims` input (`[B, C, H, W]`): the
    /// whole input's, and each tile's when the input is larger than one tile. None for
    /// another shape.
    pub fn cost_networks(&self, direction: Direction, input_dims: &[usize]) -> Option<CostNetworks> {
        let &[batch, _, h, w] = input_dims else { return None };
        let c = self.config();
        let elem = self.dtype().size_in_bytes() as u64;
        let pass = |extent: [usize; 2]| match direction {
            Direction::Decode => Some(decoder(c, extent, elem, batch)),
            Direction::Encode => Some(encoder(c, extent, elem, batch)),
        };
        let levels = c.levels() as u32;
        let layout = match direction {
            Direction::Decode if self.tiling().needs_tiling_decode(h, w) => {
                self.tiling().decode_layout(h, w, c.spatial_scale()).ok()
            }
            Direction::Encode if self.tiling().needs_tiling_encode(h, w) => {
                self.tiling().encode_layout(h, w, |n| n >> (levels - 1)).ok()
            }
            _ => None,
        };
        CostNetworks::stitched([h, w], layout, pass)
    }
}
