//! Padding a video clip `[B, C, T, H, W]` before an unpadded 3-D conv, as the video VAEs whose
//! convs pad H and W by a rule of their own (HunyuanVideo-1.5 by repeating edges, LTX-2 by
//! reflection, LTX-Video with zeros) and time by repeating edge frames do, on a whole clip or on
//! this rank's band (or block) of one: inside a shard the neighbours' rows and columns are the
//! padding, and the rule applies only at the global edges.

use vae_tensor::Tensor;

use crate::layers::Band;
use crate::{ModelError, Result};

/// How H and W are padded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Edge {
    /// Zeros (`padding_mode="zeros"`).
    Zeros,
    /// The nearest row or column (`mode="replicate"`).
    Repeat,
    /// The rows and columns inside the edge, mirrored (`padding_mode="reflect"`: row −1 is row 1).
    Reflect,
}

/// The extents of a clip `[B, C, T, H, W]`.
pub(crate) fn clip_dims(x: &Tensor) -> Result<[usize; 5]> {
    match *x.dims() {
        [b, c, t, h, w] => Ok([b, c, t, h, w]),
        ref other => Err(ModelError::InvalidInput(format!("expected a clip [B, C, T, H, W], got {other:?}"))),
    }
}

/// Along one dimension of `n` padded by `before` and `after` under `edge`: (destination, source,
/// length) of each slab of the padded copy (zero slabs are the buffer's zeros).
fn slabs(n: usize, before: usize, after: usize, edge: Edge) -> Vec<(usize, usize, usize)> {
    let mut v = Vec::with_capacity(before + after + 1);
    match edge {
        Edge::Repeat => v.extend((0..before).map(|i| (i, 0, 1))),
        Edge::Reflect => v.extend((0..before).map(|i| (i, before - i, 1))),
        Edge::Zeros => {}
    }
    v.push((before, 0, n));
    match edge {
        Edge::Repeat => v.extend((0..after).map(|i| (before + n + i, n - 1, 1))),
        Edge::Reflect => v.extend((0..after).map(|i| (before + n + i, n - 2 - i, 1))),
        Edge::Zeros => {}
    }
    v
}

/// The clip padded by `pad = [t_front, t_back, top, bottom, left, right]`: edge frames repeated
/// in time, `spatial` in H and W (as `torch.cat` of repeated frames, then `F.pad`). One buffer of
/// the padded size, filled by box copies (the interior once, then the edge slabs).
pub(crate) fn pad_clip(x: &Tensor, pad: [usize; 6], spatial: Edge) -> Result<Tensor> {
    let [b, c, t, h, w] = clip_dims(x)?;
    if t == 0 || h == 0 || w == 0 {
        return Err(ModelError::InvalidInput(format!("cannot pad an empty clip {:?}", x.dims())));
    }
    if spatial == Edge::Reflect && (pad[2].max(pad[3]) >= h || pad[4].max(pad[5]) >= w) {
        return Err(ModelError::InvalidInput(format!(
            "reflect padding of {:?} needs H and W above the padding; a map of {h}x{w} is too small (the \
             decoder's latent, or a tile of it, must be at least 2x2)",
            &pad[2..]
        )));
    }
    if pad == [0; 6] {
        return Ok(x.clone());
    }
    let dims = vec![b, c, t + pad[0] + pad[1], h + pad[2] + pad[3], w + pad[4] + pad[5]];
    let mut out = Tensor::zeros(dims, x.dtype(), &x.device())?;
    let hs = slabs(h, pad[2], pad[3], spatial);
    let ws = slabs(w, pad[4], pad[5], spatial);
    for (dt, st, lt) in slabs(t, pad[0], pad[1], Edge::Repeat) {
        for &(dh, sh, lh) in &hs {
            for &(dw, sw, lw) in &ws {
                out.copy_box_from(&[0, 0, dt, dh, dw], x, &[0, 0, st, sh, sw], &[b, c, lt, lh, lw])?;
            }
        }
    }
    Ok(out)
}

/// The clip a `k × k × k` conv reads, padded: `time = (front, back)` repeated frames, `k / 2`
/// rows and columns under `spatial`. On a band (or a block of a 2-D grid), the rows along each
/// cut axis are the neighbours' (exchanged), and `spatial` pads only where the part meets a
/// global edge.
pub(crate) fn padded_for_conv(
    x: &Tensor,
    k: usize,
    time: (usize, usize),
    spatial: Edge,
    band: &mut Band<'_, '_>,
) -> Result<Tensor> {
    let p = k / 2;
    let mut pad = [time.0, time.1, p, p, p, p];
    let Some(ctx) = band.as_deref_mut() else { return pad_clip(x, pad, spatial) };
    let (cut, neighbours) = (ctx.halo_axes(), ctx.neighbours());
    let mut rows = ctx.with_halo(x, p)?;
    // with_halo leaves zero rows (and columns) at a global edge: right for zero padding; any
    // other rule drops them and pads the part's own there instead. Along both axes of a block,
    // the rule then pads the rows the other axis's halo widened: what the whole map's padding
    // holds at those places, corners included.
    let ruled = spatial != Edge::Zeros;
    for k in (0..2).filter(|&k| cut[k]) {
        let dim = 3 + k;
        let before = if ruled && !neighbours[k][0] { p } else { 0 };
        let after = if ruled && !neighbours[k][1] { p } else { 0 };
        pad[2 + 2 * k] = before;
        pad[3 + 2 * k] = after;
        if before + after > 0 {
            let n = rows.dims()[dim];
            rows = rows.narrow(dim, before, n - before - after)?;
        }
    }
    pad_clip(&rows, pad, spatial)
}

#[cfg(test)]
mod tests {
    use vae_tensor::Device;

    use super::*;

    /// Every element of the padded clip against its definition: time clamps to the nearest
    /// frame; H and W clamp (repeat), mirror (reflect) or give 0 (zeros).
    #[test]
    fn padding_follows_each_rule_element_by_element() {
        let dims = [2, 3, 2, 3, 4];
        let n: usize = dims.iter().product();
        let x = Tensor::from_vec((0..n).map(|v| v as f32 + 1.0).collect(), dims.to_vec(), &Device::Cpu).unwrap();
        let src = x.to_vec_f32().unwrap();
        let [b, c, t, h, w] = dims;
        let pad = [2, 1, 1, 1, 2, 1];
        // Padded index i → source index, or None for a zero.
        let map = |i: usize, before: usize, len: usize, edge: Edge| -> Option<usize> {
            let j = i as isize - before as isize;
            match edge {
                _ if (0..len as isize).contains(&j) => Some(j as usize),
                Edge::Repeat => Some(j.clamp(0, len as isize - 1) as usize),
                Edge::Reflect => Some(if j < 0 { (-j) as usize } else { 2 * (len - 1) - j as usize }),
                Edge::Zeros => None,
            }
        };
        for edge in [Edge::Zeros, Edge::Repeat, Edge::Reflect] {
            let got = pad_clip(&x, pad, edge).unwrap();
            let (tp, hp, wp) = (t + pad[0] + pad[1], h + pad[2] + pad[3], w + pad[4] + pad[5]);
            assert_eq!(got.dims(), [b, c, tp, hp, wp]);
            let out = got.to_vec_f32().unwrap();
            let mut k = 0;
            for bc in 0..b * c {
                for ti in 0..tp {
                    let st = map(ti, pad[0], t, Edge::Repeat).unwrap();
                    for hi in 0..hp {
                        for wi in 0..wp {
                            let want = match (map(hi, pad[2], h, edge), map(wi, pad[4], w, edge)) {
                                (Some(sh), Some(sw)) => src[((bc * t + st) * h + sh) * w + sw],
                                _ => 0.0,
                            };
                            assert_eq!(out[k], want, "{edge:?} at {bc} {ti} {hi} {wi}");
                            k += 1;
                        }
                    }
                }
            }
        }
        let thin = Tensor::from_vec(vec![1.0; 4], vec![1, 1, 1, 1, 4], &Device::Cpu).unwrap();
        assert!(pad_clip(&thin, [0, 0, 1, 1, 1, 1], Edge::Reflect).is_err());
        assert!(pad_clip(&thin, [0, 0, 1, 1, 1, 1], Edge::Repeat).is_ok());
    }
}
