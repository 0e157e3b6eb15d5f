//! One forward pass's state: the causal feature cache of the request and, on a spatial shard,
//! this rank's band; and the conv that feeds through the cache.

use std::borrow::Cow;

use vae_runtime::ShardContext;
use vae_tensor::Tensor;

use super::layers::CausalConv3d;
use crate::Result;

/// Frames of each causal conv's input that the next chunk needs (diffusers' `CACHE_T`).
pub(super) const CACHE_T: usize = 2;

/// One slot per causal conv (and per temporal upsample) in visit order; request-scoped.
pub(super) enum Slot {
    Empty,
    /// The first chunk's marker of a temporal upsample (diffusers' `"Rep"`).
    Rep,
    Frames(Tensor),
}

/// What the layers of one request carry from chunk to chunk (the cache slots, visited in
/// layer order) and, on a spatial shard, the rank's band for the halo exchanges.
pub(super) struct Pass<'b, 'c> {
    slots: Vec<Slot>,
    next: usize,
    /// This rank's band of a spatial-shard request, or `None` for the whole map.
    pub(super) band: Option<&'b mut ShardContext<'c>>,
}

impl<'b, 'c> Pass<'b, 'c> {
    /// A fresh cache, on the whole map or on `band`.
    pub(super) fn new(band: Option<&'b mut ShardContext<'c>>) -> Self {
        Self { slots: Vec::new(), next: 0, band }
    }

    /// Starts the next chunk (latent frame or group of frames): the layers visit their slots
    /// from the first again.
    pub(super) fn next_chunk(&mut self) {
        self.next = 0;
    }

    /// The next layer's slot.
    pub(super) fn slot(&mut self) -> &mut Slot {
        let at = self.advance();
        &mut self.slots[at]
    }

    /// Moves to the next layer's slot (made on the first chunk) and returns its index.
    fn advance(&mut self) -> usize {
        if self.next == self.slots.len() {
            self.slots.push(Slot::Empty);
        }
        self.next += 1;
        self.next - 1
    }

    /// A causal conv fed through the cache, as every 3×3×3 conv of the decoder is.
    ///
    /// On a band, the conv input gets its halo rows from the neighbours while the rows that
    /// need none are computed ([`ShardContext::conv_with_halo`]); the cache then holds frames
    /// with their halos, so only the new frames' rows travel (the cached frames' halos arrived
    /// with them).
    pub(super) fn cached_conv(&mut self, conv: &CausalConv3d, x: Cow<'_, Tensor>) -> Result<Tensor> {
        let at = self.advance();
        let slot = &mut self.slots[at];
        let previous = match slot {
            Slot::Frames(t) => Some(&*t),
            _ => None,
        };
        let (out, tail) = match self.band.as_deref_mut() {
            Some(ctx) => {
                let halo_axes = ctx.halo_axes();
                let halo = conv.band_halo(halo_axes)?;
                if let Some(cached) = previous {
                    ctx.note_reused_halo(cached, halo);
                }
                let t = x.dims()[2];
                let keep = (2, t - t.min(CACHE_T)..t);
                let cout = conv.out_channels();
                // The interior and the edges are separate calls: pack the weights once for them.
                let (out, tail) = vae_tensor::with_packed_weights(conv.weight(), || {
                    ctx.conv_with_halo(x, halo, conv.band_align(), cout, Some(keep), &mut |piece| {
                        let cached = previous.map(|c| piece.window.narrow(c)).transpose()?;
                        conv.forward_piece(
                            piece.input,
                            cached.as_deref(),
                            piece.padding(conv.spatial_padding()),
                            piece.target,
                        )
                    })
                })?;
                let tail = tail
                    .ok_or_else(|| crate::ModelError::Unsupported("a halo conv without its frames to cache".into()))?;
                (out, tail)
            }
            None => {
                let t = x.dims()[2];
                let tail = x.narrow(2, t - t.min(CACHE_T), t.min(CACHE_T))?;
                (conv.forward(&x, previous)?, tail)
            }
        };
        *slot = Slot::Frames(frames_to_cache(tail, previous)?);
        Ok(out)
    }
}

/// What the cache keeps of a conv input whose last frames (up to `CACHE_T`) are `tail`: the
/// tail, with the previous cache's last frame in front when it has fewer (diffusers' `cache_x`
/// rule).
fn frames_to_cache(tail: Tensor, previous: Option<&Tensor>) -> Result<Tensor> {
    match previous {
        Some(prev) if tail.dims()[2] < CACHE_T => {
            let last = prev.narrow(2, prev.dims()[2] - 1, 1)?;
            Ok(Tensor::cat(&[&last, &tail], 2)?)
        }
        _ => Ok(tail),
    }
}
