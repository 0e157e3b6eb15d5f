//! Copying and zeroing boxes (a range per dimension) of row-major host buffers.
//!
//! Halo exchanges, the causal caches and the tile merges move boxes between tensors: a band's
//! edge rows or columns, a frame range, a part into its haloed copy. Walked naively (an
//! odometer over every dimension but the last, one `memcpy` per row), a box cut across the
//! last dimension (a width band's halo columns: one value per row) spends its time on the
//! walk, not the bytes. Here a box is first reduced to the fewest loops that describe it:
//! dimensions of extent 1 drop out, and trailing dimensions that are contiguous in both
//! buffers merge into one run; the innermost remaining loop is a tight strided loop, and a
//! large box is split over the rayon pool along its outermost loop (each slice of the
//! destination is written by one thread).

use rayon::prelude::*;

/// Elements a box must hold before its copy is split over the pool.
const PARALLEL_ELEMS: usize = 1 << 18;

/// A box reduced to loops: `outer` (extent, source stride, destination stride) from the
/// outermost in, each iteration of the innermost copying `run` contiguous elements; `src_at`
/// and `dst_at` are where the box starts.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Walk {
    outer: Vec<(usize, usize, usize)>,
    run: usize,
    src_at: usize,
    dst_at: usize,
}

impl Walk {
    /// The walk of a box of `extent` (no dimension empty) at `src_off` in a buffer of
    /// `src_strides` and at `dst_off` in one of `dst_strides` (row-major: the last stride 1).
    fn new(
        extent: &[usize],
        src_strides: &[usize],
        src_off: &[usize],
        dst_strides: &[usize],
        dst_off: &[usize],
    ) -> Self {
        let at = |off: &[usize], strides: &[usize]| off.iter().zip(strides).map(|(o, s)| o * s).sum();
        let (src_at, dst_at) = (at(src_off, src_strides), at(dst_off, dst_strides));
        let mut run = 1;
        let mut merging = true;
        let mut outer = Vec::new();
        for d in (0..extent.len()).rev() {
            if extent[d] == 1 {
                continue;
            }
            if merging && src_strides[d] == run && dst_strides[d] == run {
                run *= extent[d];
            } else {
                merging = false;
                outer.push((extent[d], src_strides[d], dst_strides[d]));
            }
        }
        outer.reverse();
        Self { outer, run, src_at, dst_at }
    }

    fn elems(&self) -> usize {
        self.outer.iter().map(|o| o.0).product::<usize>() * self.run
    }

    /// Calls `f(src, dst)` with the start of every run, in order.
    fn each_run(&self, mut f: impl FnMut(usize, usize)) {
        let Some((&(n, ss, ds), rest)) = self.outer.split_last() else {
            return f(self.src_at, self.dst_at);
        };
        let mut index = vec![0usize; rest.len()];
        let (mut s0, mut t0) = (self.src_at, self.dst_at);
        loop {
            for i in 0..n {
                f(s0 + i * ss, t0 + i * ds);
            }
            // Odometer over the loops outside the innermost.
            let mut d = rest.len();
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                let (m, ss, ds) = rest[d];
                index[d] += 1;
                s0 += ss;
                t0 += ds;
                if index[d] < m {
                    break;
                }
                s0 -= m * ss;
                t0 -= m * ds;
                index[d] = 0;
            }
        }
    }

    /// The walk split along its outermost loop: the destination span one iteration writes
    /// (from its start), and the walk of one iteration with both starts at that iteration's.
    fn split(&self) -> Option<(usize, usize, usize, usize, Walk)> {
        let (&(n, ss, ds), rest) = self.outer.split_first()?;
        let span = rest.iter().map(|&(m, _, d)| (m - 1) * d).sum::<usize>() + self.run;
        (n >= 2 && span <= ds)
            .then(|| (n, ss, ds, span, Walk { outer: rest.to_vec(), run: self.run, src_at: 0, dst_at: 0 }))
    }
}

/// Copies the box of `extent` at `src_off` in `src` (strides `src_strides`) to `dst_off` in
/// `dst` (strides `dst_strides`). The box must lie inside both buffers (checked by the
/// caller); no dimension of it may be empty.
pub(crate) fn copy(
    src: &[f32],
    src_strides: &[usize],
    src_off: &[usize],
    dst: &mut [f32],
    dst_strides: &[usize],
    dst_off: &[usize],
    extent: &[usize],
) {
    let walk = Walk::new(extent, src_strides, src_off, dst_strides, dst_off);
    match walk.split().filter(|_| walk.elems() >= PARALLEL_ELEMS) {
        Some((n, ss, ds, span, inner)) => {
            dst[walk.dst_at..].par_chunks_mut(ds).take(n).enumerate().for_each(|(i, slice)| {
                let src = &src[walk.src_at + i * ss..];
                copy_runs(&inner, src, &mut slice[..span]);
            });
        }
        None => copy_runs(&walk, src, dst),
    }
}

fn copy_runs(walk: &Walk, src: &[f32], dst: &mut [f32]) {
    let run = walk.run;
    if run == 1 {
        walk.each_run(|s, t| dst[t] = src[s]);
    } else {
        walk.each_run(|s, t| dst[t..t + run].copy_from_slice(&src[s..s + run]));
    }
}

/// Sets the box of `extent` at `off` in `dst` (strides `strides`) to zero. The box must lie
/// inside the buffer; no dimension of it may be empty.
pub(crate) fn zero(dst: &mut [f32], strides: &[usize], off: &[usize], extent: &[usize]) {
    let walk = Walk::new(extent, strides, off, strides, off);
    let run = walk.run;
    if run == 1 {
        // One value a run (a column): a store, not a call to fill a one-element slice.
        walk.each_run(|_, t| dst[t] = 0.0);
    } else {
        walk.each_run(|_, t| dst[t..t + run].fill(0.0));
    }
}

/// The box of `dims` outside `inner` (a range per dimension, inside `dims`) as at most two
/// boxes per dimension, `(offset, extent)`, none empty: along dimension `d`, the slabs before
/// and after `inner`, within `inner` along the dimensions before `d` and whole along those
/// after.
pub(crate) fn complement(dims: &[usize], inner: &[std::ops::Range<usize>]) -> Vec<(Vec<usize>, Vec<usize>)> {
    let mut boxes = Vec::new();
    for d in 0..dims.len() {
        for side in [0..inner[d].start, inner[d].end..dims[d]] {
            if side.is_empty() {
                continue;
            }
            let (mut off, mut extent) = (Vec::with_capacity(dims.len()), Vec::with_capacity(dims.len()));
            for k in 0..dims.len() {
                let r = match k.cmp(&d) {
                    std::cmp::Ordering::Less => inner[k].clone(),
                    std::cmp::Ordering::Equal => side.clone(),
                    std::cmp::Ordering::Greater => 0..dims[k],
                };
                off.push(r.start);
                extent.push(r.len());
            }
            if !extent.contains(&0) {
                boxes.push((off, extent));
            }
        }
    }
    boxes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strides(dims: &[usize]) -> Vec<usize> {
        let mut s = vec![1; dims.len()];
        for d in (0..dims.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * dims[d + 1];
        }
        s
    }

    /// The plain odometer over every index of the box, one element at a time.
    fn naive(src: &[f32], sd: &[usize], so: &[usize], dst: &mut [f32], dd: &[usize], to: &[usize], extent: &[usize]) {
        let (ss, ts) = (strides(sd), strides(dd));
        let total: usize = extent.iter().product();
        for flat in 0..total {
            let (mut rem, mut s, mut t) = (flat, 0, 0);
            for d in (0..extent.len()).rev() {
                let i = rem % extent[d];
                rem /= extent[d];
                s += (so[d] + i) * ss[d];
                t += (to[d] + i) * ts[d];
            }
            dst[t] = src[s];
        }
    }

    /// A box case: source dims, source offset, destination dims, destination offset, extent.
    type Case<'a> = (&'a [usize], &'a [usize], &'a [usize], &'a [usize], &'a [usize]);

    /// Boxes of every kind (whole rows, single columns, frame ranges, extents of 1 anywhere,
    /// large enough to split over the pool) copy what the element-wise odometer copies.
    #[test]
    fn every_box_copies_what_the_odometer_does() {
        let cases: &[Case<'_>] = &[
            // (src dims, src off, dst dims, dst off, extent)
            (&[2, 3, 4, 5], &[0, 0, 0, 3], &[2, 3, 4, 2], &[0, 0, 0, 0], &[2, 3, 4, 2]),
            (&[2, 3, 4, 5], &[0, 0, 0, 4], &[2, 3, 4, 1], &[0, 0, 0, 0], &[2, 3, 4, 1]),
            (&[1, 3, 4, 5], &[0, 0, 1, 0], &[1, 3, 6, 7], &[0, 0, 1, 1], &[1, 3, 3, 5]),
            (&[1, 4, 3, 6, 5], &[0, 0, 1, 0, 0], &[1, 4, 2, 6, 5], &[0, 0, 0, 0, 0], &[1, 4, 2, 6, 5]),
            (&[1, 1, 1, 1], &[0, 0, 0, 0], &[1, 1, 1, 1], &[0, 0, 0, 0], &[1, 1, 1, 1]),
            (&[3, 1, 4], &[1, 0, 1], &[2, 2, 5], &[0, 1, 0], &[2, 1, 3]),
            (&[1, 64, 70, 80], &[0, 0, 0, 40], &[1, 64, 72, 42], &[0, 0, 1, 1], &[1, 64, 70, 40]),
            (&[1, 64, 70, 80], &[0, 0, 0, 79], &[1, 64, 72, 1], &[0, 0, 1, 0], &[1, 64, 70, 1]),
            (&[1, 96, 2, 48, 40], &[0, 0, 0, 0, 0], &[1, 96, 2, 50, 42], &[0, 0, 0, 1, 1], &[1, 96, 2, 48, 40]),
        ];
        for &(sd, so, dd, to, extent) in cases {
            let n: usize = sd.iter().product();
            let src: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
            let m: usize = dd.iter().product();
            let mut want = vec![-1.0; m];
            naive(&src, sd, so, &mut want, dd, to, extent);
            let mut got = vec![-1.0; m];
            copy(&src, &strides(sd), so, &mut got, &strides(dd), to, extent);
            assert_eq!(got, want, "{sd:?} at {so:?} -> {dd:?} at {to:?}, extent {extent:?}");
        }
    }

    #[test]
    fn boxes_reduce_to_the_fewest_loops() {
        let w = |sd: &[usize], dd: &[usize], extent: &[usize]| {
            let z = vec![0; sd.len()];
            Walk::new(extent, &strides(sd), &z, &strides(dd), &z)
        };
        // A frame range of NCTHW: the frames' H × W merge into one run, C stays a loop.
        let frames = w(&[1, 8, 5, 6, 7], &[1, 8, 2, 6, 7], &[1, 8, 2, 6, 7]);
        assert_eq!((frames.outer.clone(), frames.run), (vec![(8, 5 * 42, 2 * 42)], 2 * 42));
        // One column of a map: a single loop of stride W over C × H.
        let column = w(&[1, 4, 6, 9], &[1, 4, 6, 1], &[1, 4, 6, 1]);
        assert_eq!((column.outer.clone(), column.run), (vec![(4, 54, 6), (6, 9, 1)], 1));
        // A whole tensor: one run.
        assert_eq!(w(&[2, 3, 4], &[2, 3, 4], &[2, 3, 4]).outer, vec![]);
    }

    #[test]
    fn the_complement_covers_the_rest_once() {
        let dims = [2, 5, 7];
        let inner = [0..2, 1..4, 2..7];
        let mut count = vec![0; 2 * 5 * 7];
        for (off, extent) in complement(&dims, &inner) {
            for a in off[0]..off[0] + extent[0] {
                for b in off[1]..off[1] + extent[1] {
                    for c in off[2]..off[2] + extent[2] {
                        count[(a * 5 + b) * 7 + c] += 1;
                    }
                }
            }
        }
        for a in 0..2 {
            for b in 0..5 {
                for c in 0..7 {
                    let inside = inner[0].contains(&a) && inner[1].contains(&b) && inner[2].contains(&c);
                    assert_eq!(count[(a * 5 + b) * 7 + c], usize::from(!inside), "{a} {b} {c}");
                }
            }
        }
        let mut z = vec![1.0; 2 * 5 * 7];
        for (off, extent) in complement(&dims, &inner) {
            zero(&mut z, &strides(&dims), &off, &extent);
        }
        assert_eq!(z.iter().filter(|&&v| v == 0.0).count(), 70 - 2 * 3 * 5);
    }
}
