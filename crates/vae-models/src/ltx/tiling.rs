//! The tile geometry of the LTX classes: `tiled_decode` / `tiled_encode` over H and W (the
//! Wan scheme: tiles of `tile_sample_min` every `tile_sample_stride` pixels, their latent sizes
//! those over the class's `spatial_compression_ratio`), and `_temporal_tiled_decode` /
//! `_temporal_tiled_encode` over frames, which diffusers runs when `use_framewise_decoding` is
//! set (for the encoder too).
//!
//! Over time, decode chunks take `tile_latent_min_num_frames + 1` latent frames every
//! `tile_latent_stride_num_frames`; every chunk after the first drops its last decoded frame;
//! each chunk is blended with the one before (already blended) over
//! `tile_sample_min_num_frames − tile_sample_stride_num_frames` frames; the first keeps
//! `stride + 1` frames, the others `stride`; the result is cut to `(T − 1)·ratio + 1` frames.
//! Encode chunks take `tile_sample_min_num_frames + 1` frames every `stride` frames and drop
//! their first latent frame instead, in latent units otherwise. Both reproduce the classes'
//! arithmetic, quirks included.

use std::ops::Range;

use vae_planner::{BlendRamp, WanTiling};
use vae_tensor::Tensor;

use crate::{ModelError, Result};

/// The tiling attributes of the classes, and whether the frames are tiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LtxTiling {
    /// H and W: `tile_sample_min_height` / `_width`, `tile_sample_stride_height` / `_width`,
    /// and the class's `spatial_compression_ratio` (no patching in the merge).
    pub spatial: WanTiling,
    /// `tile_sample_min_num_frames`.
    pub tile_sample_min_num_frames: usize,
    /// `tile_sample_stride_num_frames`.
    pub tile_sample_stride_num_frames: usize,
    /// `use_framewise_decoding` (which gates the temporal encode too).
    pub framewise: bool,
    /// The class's `temporal_compression_ratio`.
    pub temporal_compression_ratio: usize,
}

/// Which frame a chunk after the first drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// Its last decoded frame (decode).
    Last,
    /// Its first latent frame (encode).
    First,
}

/// How the chunks of a temporal tiling are merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemporalMerge {
    /// Frames blended with the chunk before (`min(·)` with both chunks' lengths).
    pub blend: usize,
    /// Frames the first chunk keeps.
    pub keep_first: usize,
    /// Frames every later chunk keeps.
    pub keep: usize,
    /// The output's frames.
    pub crop: usize,
    /// What every chunk after the first drops before the merge.
    pub dropped: Dropped,
}

impl LtxTiling {
    /// The classes' defaults: 512-pixel tiles every 448, 16-frame tiles every 8, frames untiled.
    pub fn new(spatial_ratio: usize, temporal_ratio: usize) -> Self {
        Self {
            spatial: WanTiling {
                tile_sample_min_height: 512,
                tile_sample_min_width: 512,
                tile_sample_stride_height: 448,
                tile_sample_stride_width: 448,
                spatial_compression_ratio: spatial_ratio,
                patch_size: None,
            },
            tile_sample_min_num_frames: 16,
            tile_sample_stride_num_frames: 8,
            framewise: false,
            temporal_compression_ratio: temporal_ratio,
        }
    }

    /// Refuses sizes the class would fail on: empty tiles or strides, a latent tile or stride of
    /// zero (a `range` step of 0 raises).
    pub fn check(&self) -> Result<()> {
        let s = &self.spatial;
        let sizes = [
            s.tile_sample_min_height,
            s.tile_sample_min_width,
            s.tile_sample_stride_height,
            s.tile_sample_stride_width,
            self.tile_sample_min_num_frames,
            self.tile_sample_stride_num_frames,
        ];
        if sizes.contains(&0) || s.spatial_compression_ratio == 0 || self.temporal_compression_ratio == 0 {
            return Err(ModelError::InvalidInput(format!(
                "tile sizes, strides and compression ratios must be positive, got {self:?}"
            )));
        }
        let (r, rt) = (s.spatial_compression_ratio, self.temporal_compression_ratio);
        for (v, what) in [(s.tile_sample_stride_height, "height"), (s.tile_sample_stride_width, "width")] {
            if v < r {
                return Err(ModelError::InvalidInput(format!(
                    "tile_sample_stride_{what} {v} is under the {r}x spatial compression: its latent stride \
                     {v} // {r} would be 0"
                )));
            }
        }
        if self.framewise && self.tile_sample_stride_num_frames < rt {
            return Err(ModelError::InvalidInput(format!(
                "tile_sample_stride_num_frames {} is under the {rt}x temporal compression: its latent stride \
                 would be 0",
                self.tile_sample_stride_num_frames
            )));
        }
        Ok(())
    }

    /// Latent frames of a decode chunk before the one extra (`tile_latent_min_num_frames`).
    fn latent_min_frames(&self) -> usize {
        self.tile_sample_min_num_frames / self.temporal_compression_ratio
    }

    fn latent_stride_frames(&self) -> usize {
        self.tile_sample_stride_num_frames / self.temporal_compression_ratio
    }

    /// `_decode`'s temporal test on `t` latent frames.
    pub fn tiles_frames_decode(&self, t: usize) -> bool {
        self.framewise && t > self.latent_min_frames()
    }

    /// `_encode`'s temporal test on `f` frames.
    pub fn tiles_frames_encode(&self, f: usize) -> bool {
        self.framewise && f > self.tile_sample_min_num_frames
    }

    /// Python's `range(0, n, stride)` of chunks `[i, min(i + len, n))`.
    fn chunks(n: usize, len: usize, stride: usize) -> Result<Vec<Range<usize>>> {
        if stride == 0 {
            return Err(ModelError::InvalidInput("a temporal tile stride of 0 frames".into()));
        }
        Ok((0..n).step_by(stride).map(|i| i..(i + len).min(n)).collect())
    }

    /// The latent-frame chunks of a temporally tiled decode of `t` latent frames, and their merge.
    pub fn decode_chunks(&self, t: usize) -> Result<(Vec<Range<usize>>, TemporalMerge)> {
        self.check()?;
        let chunks = Self::chunks(t, self.latent_min_frames() + 1, self.latent_stride_frames())?;
        let s = self.tile_sample_stride_num_frames;
        let merge = TemporalMerge {
            blend: self.tile_sample_min_num_frames.saturating_sub(s),
            keep_first: s + 1,
            keep: s,
            crop: t.saturating_sub(1) * self.temporal_compression_ratio + 1,
            dropped: Dropped::Last,
        };
        Ok((chunks, merge))
    }

    /// The frame chunks of a temporally tiled encode of `f` frames, and their merge.
    pub fn encode_chunks(&self, f: usize) -> Result<(Vec<Range<usize>>, TemporalMerge)> {
        self.check()?;
        let chunks = Self::chunks(f, self.tile_sample_min_num_frames + 1, self.tile_sample_stride_num_frames)?;
        let s = self.latent_stride_frames();
        let merge = TemporalMerge {
            blend: self.latent_min_frames().saturating_sub(s),
            keep_first: s + 1,
            keep: s,
            crop: f.saturating_sub(1) / self.temporal_compression_ratio + 1,
            dropped: Dropped::First,
        };
        Ok((chunks, merge))
    }
}

impl TemporalMerge {
    /// Chunk `i`'s output as the merge takes it: without its dropped frame after the first
    /// chunk; `None` when nothing is left (a one-frame chunk).
    fn trim(&self, i: usize, out: Tensor) -> Result<Option<Tensor>> {
        let n = out.dims()[2];
        if i == 0 {
            return Ok(Some(out));
        }
        if n <= 1 {
            return Ok(None);
        }
        Ok(Some(match self.dropped {
            Dropped::Last => out.narrow(2, 0, n - 1)?,
            Dropped::First => out.narrow(2, 1, n - 1)?,
        }))
    }

    /// The chunks' outputs (in order, whole) merged: each after the first trimmed, then
    /// `blend_t` in scan order (each chunk reading the one before as already blended), each cut
    /// to what it keeps, concatenated along time and cut to `crop` frames.
    pub fn merge(&self, chunks: Vec<Tensor>) -> Result<Tensor> {
        let first = chunks.first().ok_or_else(|| ModelError::InvalidInput("no temporal tiles".into()))?;
        let mut dims = first.dims().to_vec();
        let (dtype, device) = (first.dtype(), first.device());
        let mut chunks: Vec<Option<Tensor>> =
            chunks.into_iter().enumerate().map(|(i, c)| self.trim(i, c)).collect::<Result<_>>()?;
        for i in 1..chunks.len() {
            let (before, rest) = chunks.split_at_mut(i);
            if let (Some(prev), Some(cur)) = (&before[i - 1], &mut rest[0]) {
                let e = self.blend.min(prev.dims()[2]).min(cur.dims()[2]);
                if e > 0 {
                    cur.blend_leading(prev, 2, BlendRamp::new(e).weights())?;
                }
            }
        }
        let kept: Vec<usize> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| c.as_ref().map_or(0, |c| c.dims()[2].min(if i == 0 { self.keep_first } else { self.keep })))
            .collect();
        let total: usize = kept.iter().sum::<usize>().min(self.crop);
        dims[2] = total;
        let mut out = Tensor::zeros(dims.clone(), dtype, &device)?;
        let mut at = 0;
        for (chunk, keep) in chunks.iter().zip(kept) {
            let n = keep.min(total - at);
            let Some(chunk) = chunk.as_ref().filter(|_| n > 0) else { continue };
            let d = chunk.dims();
            if d.len() != dims.len() || d[3..] != dims[3..] || d[..2] != dims[..2] {
                return Err(ModelError::InvalidInput(format!(
                    "temporal tiles of shapes {dims:?} and {d:?} do not line up"
                )));
            }
            let mut extent = dims.clone();
            extent[2] = n;
            out.copy_box_from(&[0, 0, at, 0, 0], chunk, &[0; 5], &extent)?;
            at += n;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use vae_tensor::Device;

    use super::*;

    fn framewise(min: usize, stride: usize) -> LtxTiling {
        LtxTiling {
            tile_sample_min_num_frames: min,
            tile_sample_stride_num_frames: stride,
            framewise: true,
            ..LtxTiling::new(32, 8)
        }
    }

    #[test]
    fn decode_chunks_overlap_by_one_latent_frame_beyond_the_tile() {
        let t = framewise(16, 8);
        assert!(!t.tiles_frames_decode(2) && t.tiles_frames_decode(3));
        let (chunks, merge) = t.decode_chunks(5).unwrap();
        assert_eq!(chunks, [0..3, 1..4, 2..5, 3..5, 4..5]);
        assert_eq!((merge.blend, merge.keep_first, merge.keep, merge.crop), (8, 9, 8, 33));
        let (chunks, merge) = t.encode_chunks(33).unwrap();
        assert_eq!(chunks, [0..17, 8..25, 16..33, 24..33, 32..33]);
        assert_eq!((merge.blend, merge.keep_first, merge.keep, merge.crop), (1, 2, 1, 5));
    }

    #[test]
    fn merging_blends_in_scan_order_and_keeps_the_first_chunks_extra_frame() {
        let merge = TemporalMerge { blend: 2, keep_first: 3, keep: 2, crop: 6, dropped: Dropped::Last };
        let chunk = |vals: &[f32]| Tensor::from_vec(vals.to_vec(), vec![1, 1, vals.len(), 1, 1], &Device::Cpu).unwrap();
        // Chunks after the first lose their last frame (and a one-frame chunk is then empty).
        let chunks =
            vec![chunk(&[0., 1., 2., 3.]), chunk(&[10., 10., 10., -1.]), chunk(&[20., 20., -1.]), chunk(&[5.])];
        let out = merge.merge(chunks).unwrap();
        // Chunk 1 blends over 2 frames with chunk 0's last two: 2·1 + 10·0 = 2, 3·0.5 + 10·0.5 = 6.5;
        // chunk 2 with chunk 1's (blended) last two: 6.5, then 10·0.5 + 20·0.5 = 15.
        assert_eq!(out.to_vec_f32().unwrap(), [0., 1., 2., 2., 6.5, 6.5]);
        let first = TemporalMerge { dropped: Dropped::First, crop: 9, ..merge };
        let out = first.merge(vec![chunk(&[0., 1., 2.]), chunk(&[-1., 7., 7.])]).unwrap();
        assert_eq!(out.to_vec_f32().unwrap(), [0., 1., 2., 1., 4.5]);
    }

    #[test]
    fn strides_under_the_compression_are_refused() {
        assert!(framewise(16, 4).check().is_err());
        let mut t = LtxTiling::new(32, 8);
        t.spatial.tile_sample_stride_height = 16;
        assert!(t.check().unwrap_err().to_string().contains("would be 0"));
    }
}
