//! `WanResample`: the decoder's spatial / spatio-temporal upsampling and the encoder's
//! downsampling.

use std::borrow::Cow;

use vae_planner::ShardAxis;
use vae_tensor::{Conv2dParams, Tensor};

use super::cache::{CACHE_T, Pass, Slot};
use super::layers::{CausalConv3d, kernel_halo};
use crate::Result;
use crate::layers::Conv2d;
use crate::weights::Weights;

/// `WanResample` in the decoder's two modes.
pub(super) struct Upsample {
    conv: Conv2d,
    time_conv: Option<CausalConv3d>,
    /// Rows one latent row has become after the upsampling (see `CausalConv3d::band_align`).
    band_align: usize,
}

impl Upsample {
    /// `out_dim`: `dim / 2` in Wan2.1's up blocks, `dim` in Wan2.2's residual ones; `align`:
    /// rows one latent row has become after the upsampling.
    /// Whether it doubles the frame count (every latent frame after the first).
    pub(super) fn is_temporal(&self) -> bool {
        self.time_conv.is_some()
    }

    pub(super) fn load(w: &mut Weights<'_>, dim: usize, out_dim: usize, temporal: bool, align: usize) -> Result<Self> {
        let conv = Conv2d::load(&mut w.pp("resample.1"), dim, out_dim, 3, Conv2dParams::same(3).band_aligned(align))?;
        let time_conv = if temporal {
            Some(CausalConv3d::load(&mut w.pp("time_conv"), dim, 2 * dim, [3, 1, 1], [1, 0, 0])?)
        } else {
            None
        };
        Ok(Self { conv, time_conv, band_align: align })
    }

    /// Rows of each neighbour the 3×3 resample conv needs.
    pub(super) fn halo(&self, axis: ShardAxis) -> usize {
        kernel_halo(self.conv.weight(), axis)
    }

    /// Frees every weight (see [`Conv2d::release`]); it still says whether it is temporal.
    pub(super) fn release(&mut self) -> Result<()> {
        self.conv.release()?;
        self.time_conv.as_mut().map_or(Ok(()), CausalConv3d::release)
    }

    /// The resample conv's weight elements: multiply-adds per output pixel.
    pub(super) fn conv_weight_elements(&self) -> u64 {
        self.conv.weight().elem_count() as u64
    }

    /// The time conv's weight elements (0 without one): multiply-adds per input pixel.
    pub(super) fn time_weight_elements(&self) -> u64 {
        self.time_conv.as_ref().map_or(0, CausalConv3d::weight_elements)
    }

    /// The time conv (3×1×1) and the nearest upsample are local on a band (the band doubles);
    /// only the 3×3 resample conv takes halo rows.
    pub(super) fn forward(&self, x: &Tensor, pass: &mut Pass<'_, '_>) -> Result<Tensor> {
        let mut x = x.clone();
        if let Some(time_conv) = &self.time_conv {
            let slot = pass.slot();
            match slot {
                // The first chunk: no temporal upsampling, only the marker.
                Slot::Empty => *slot = Slot::Rep,
                Slot::Rep | Slot::Frames(_) => {
                    let d = x.dims().to_vec();
                    let (b, c, t, h, w) = (d[0], d[1], d[2], d[3], d[4]);
                    let keep = t.min(CACHE_T);
                    let mut to_cache = x.narrow(2, t - keep, keep)?;
                    let out = match slot {
                        Slot::Frames(prev) => {
                            if keep < CACHE_T {
                                let last = prev.narrow(2, prev.dims()[2] - 1, 1)?;
                                to_cache = Tensor::cat(&[&last, &to_cache], 2)?;
                            }
                            time_conv.forward(&x, Some(prev))?
                        }
                        _ => {
                            if keep < CACHE_T {
                                let zeros =
                                    Tensor::zeros(to_cache.dims().to_vec(), to_cache.dtype(), &to_cache.device())?;
                                to_cache = Tensor::cat(&[&zeros, &to_cache], 2)?;
                            }
                            time_conv.forward(&x, None)?
                        }
                    };
                    *slot = Slot::Frames(to_cache);
                    // [b, 2c, t, h, w] → [b, 2, c, t, h, w] → frames interleaved → [b, c, 2t, h, w]
                    x = out.reshape(vec![b, 2, c, t, h, w])?.permute(&[0, 2, 3, 1, 4, 5])?.reshape(vec![
                        b,
                        c,
                        2 * t,
                        h,
                        w,
                    ])?;
                }
            }
        }
        let d = x.dims().to_vec();
        let (b, c, t, h, w) = (d[0], d[1], d[2], d[3], d[4]);
        let frames = x.permute(&[0, 2, 1, 3, 4])?.reshape(vec![b * t, c, h, w])?;
        // nearest-exact with an integer factor is plain nearest.
        let up = match pass.band.as_deref_mut() {
            None => self.conv.forward_upsampled(&frames)?,
            Some(ctx) => {
                let [cut_h, cut_w] = ctx.halo_axes();
                let halo = super::layers::square_halo(self.conv.weight(), [cut_h, cut_w])?;
                let upsampled = frames.upsample_nearest2d(2)?;
                let own = self.conv.params().padding;
                let cout = self.conv.out_channels();
                let (up, _) = vae_tensor::with_packed_weights(self.conv.weight(), || {
                    ctx.conv_with_halo(Cow::Owned(upsampled), halo, self.band_align, cout, None, &mut |piece| {
                        let params = Conv2dParams::new(1, piece.padding(own)).band_aligned(self.band_align);
                        self.conv.forward_into(piece.input, &params, piece.target)
                    })
                })?;
                up
            }
        };
        let co = up.dims()[1];
        Ok(up.reshape(vec![b, t, co, 2 * h, 2 * w])?.permute(&[0, 2, 1, 3, 4])?)
    }
}

/// `WanResample` in the encoder's two modes: a per-frame stride-2 conv after padding right and
/// bottom, and for `downsample3d` a stride-2 time conv over the cached last frame and the chunk.
pub(super) struct Downsample {
    conv: Conv2d,
    time_conv: Option<CausalConv3d>,
}

impl Downsample {
    pub(super) fn load(w: &mut Weights<'_>, dim: usize, temporal: bool) -> Result<Self> {
        let conv = Conv2d::load(&mut w.pp("resample.1"), dim, dim, 3, Conv2dParams::diffusers_downsample())?;
        let time_conv = if temporal {
            let mut t = CausalConv3d::load(&mut w.pp("time_conv"), dim, dim, [3, 1, 1], [0, 0, 0])?;
            t.time_stride = 2;
            Some(t)
        } else {
            None
        };
        Ok(Self { conv, time_conv })
    }

    pub(super) fn forward(&self, x: &Tensor, pass: &mut Pass<'_, '_>) -> Result<Tensor> {
        let d = x.dims().to_vec();
        let (b, c, t, h, w) = (d[0], d[1], d[2], d[3], d[4]);
        let frames = x.permute(&[0, 2, 1, 3, 4])?.reshape(vec![b * t, c, h, w])?;
        // On a band (of whole latent rows: even), one halo row of the next band.
        let down = crate::layers::downsample_on(&self.conv, &frames, &mut pass.band)?;
        let (co, ho, wo) = (down.dims()[1], down.dims()[2], down.dims()[3]);
        let x = down.reshape(vec![b, t, co, ho, wo])?.permute(&[0, 2, 1, 3, 4])?;
        let Some(time_conv) = &self.time_conv else { return Ok(x) };
        let slot = pass.slot();
        match slot {
            // The first chunk only fills the cache; time is not halved yet.
            Slot::Empty | Slot::Rep => {
                *slot = Slot::Frames(x.clone());
                Ok(x)
            }
            Slot::Frames(prev) => {
                let last = prev.narrow(2, prev.dims()[2] - 1, 1)?;
                let to_cache = x.narrow(2, x.dims()[2] - 1, 1)?;
                let out = time_conv.forward(&Tensor::cat(&[&last, &x], 2)?, None)?;
                *slot = Slot::Frames(to_cache);
                Ok(out)
            }
        }
    }
}
