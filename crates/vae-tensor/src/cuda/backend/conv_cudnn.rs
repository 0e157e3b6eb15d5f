//! The convolution on cuDNN ([`super::cudnn`]), and the per-shape choice between it and our
//! kernels ([`super::conv_choice`]) that `ConvKernels::Fastest` asks for.
//!
//! Our tensors go to cuDNN as they are (`NCDHW`) when cuDNN can express the padding (the same
//! on both sides of every dimension, the output extents cuDNN computes equal to ours); otherwise
//! (Wan's causal time padding, the bottom/right-padded stride-2 downsamples, an input in two
//! parts along time) one zero-padded `NCDHW` copy of the input is made with the padding in it,
//! by the existing box-copy kernel, and cuDNN convolves it unpadded. That is one copy of the
//! input at most, where ours always makes two (input and weights, channels-last).

use std::time::Instant;

use super::conv_choice::{self, ConvChoice, LayerKey, admissible, preferred};
use super::cudnn::{self, Descriptors, Operands, Problem};
use super::select::TensorCoreMath;
use super::storage::CudaStorage;
use crate::abi::ConvGeom;
use crate::backend::{DeviceLayout, DeviceStore};
use crate::{DType, Result, TensorError};

/// Whether cuDNN reads the input in place, and the padding it applies then (else the padded
/// copy of [`CudaStorage::padded_input`] and no padding). `None` for padding cuDNN cannot
/// express.
fn symmetric_pads(g: &ConvGeom) -> Option<[i64; 3]> {
    let dims = [
        (g.t, g.kt, g.stride_t, g.to, g.pad_front),
        (g.h, g.kh, g.stride, g.ho, g.pad_top),
        (g.w, g.kw, g.stride, g.wo, g.pad_left),
    ];
    let mut pads = [0; 3];
    for (d, &(i, k, s, o, p)) in dims.iter().enumerate() {
        let padded = i as i64 + 2 * p - k as i64;
        if p < 0 || padded < 0 || s == 0 || (padded / s as i64 + 1) as u64 != o {
            return None;
        }
        pads[d] = p;
    }
    Some(pads)
}

/// The `[t, h, w]` extents of the zero-padded copy: what the output reads, padding included.
fn padded_extents(g: &ConvGeom) -> [u64; 3] {
    [(g.to - 1) * g.stride_t + g.kt, (g.ho - 1) * g.stride + g.kh, (g.wo - 1) * g.stride + g.kw]
}

/// An extent as cuDNN's `int`.
fn int(v: u64) -> Result<i32> {
    i32::try_from(v).map_err(|_| TensorError::InvalidArgument {
        op: "conv3d (cuDNN)",
        reason: format!("extent {v} exceeds cuDNN's 32-bit int"),
    })
}

/// The convolution `g` of operands of `dtype` on this thread (TF32 mode or not) as cuDNN is
/// asked it, its input `[t, h, w]` padded by `pads` on both sides. Refused (a
/// [`TensorError::InvalidArgument`]) when an extent, a stride or an operand's element count
/// does not fit cuDNN's 32-bit `int`.
fn problem(g: &ConvGeom, dtype: DType, [t, h, w]: [u64; 3], pads: [i64; 3]) -> Result<Problem> {
    let p = Problem {
        x: [int(g.n)?, int(g.cin)?, int(t)?, int(h)?, int(w)?],
        w: [int(g.cout)?, int(g.cin)?, int(g.kt)?, int(g.kh)?, int(g.kw)?],
        pads: [int(pads[0] as u64)?, int(pads[1] as u64)?, int(pads[2] as u64)?],
        strides: [int(g.stride_t)?, int(g.stride)?, int(g.stride)?],
        y: [int(g.n)?, int(g.cout)?, int(g.to)?, int(g.ho)?, int(g.wo)?],
        dtype,
        tf32: TensorCoreMath::for_conv(dtype) == TensorCoreMath::Tf32,
    };
    for dims in [p.x, p.w, p.y] {
        cudnn::packed(dims)?;
    }
    Ok(p)
}

/// Each algorithm's seconds by `time`; one that fails is left out with a warning, so that a
/// failing candidate never fails the convolution being timed.
fn time_each(algorithms: &[u32], mut time: impl FnMut(u32) -> Result<f64>) -> Vec<(u32, f64)> {
    let mut timed = Vec::new();
    for &algorithm in algorithms {
        match time(algorithm) {
            Ok(seconds) => timed.push((algorithm, seconds)),
            Err(e) => {
                tracing::warn!(algorithm, error = %e, "a cuDNN candidate failed when timed; left out of the choice")
            }
        }
    }
    timed
}

/// The error of a problem cuDNN offers no admitted algorithm for.
fn none_admitted(problem: &Problem, offered: &[super::conv_choice::Candidate]) -> TensorError {
    TensorError::InvalidArgument {
        op: "conv3d (cuDNN)",
        reason: format!(
            "cuDNN offers no admissible algorithm for {problem:?} (offered: {offered:?}; only deterministic GEMM and \
             direct algorithms run)"
        ),
    }
}

impl CudaStorage {
    /// The input as cuDNN reads it, with the padding cuDNN applies: `self` in place where the
    /// padding is symmetric (and no `front`), else a zero-padded copy of `front` then `self`.
    fn padded_input(&self, front: Option<(&Self, u64)>, g: &ConvGeom) -> Result<(Option<Self>, [u64; 3], [i64; 3])> {
        if front.is_none()
            && let Some(pads) = symmetric_pads(g)
        {
            return Ok((None, [g.t, g.h, g.w], pads));
        }
        let ext = padded_extents(g);
        let lead = [g.pad_front, g.pad_top, g.pad_left];
        let (n, c) = (g.n as usize, g.cin as usize);
        let [tp, hp, wp] = ext.map(|e| e as i64);
        let mut padded = self.like(n * c * (tp * hp * wp) as usize)?;
        let dst = [c * (tp * hp * wp) as usize, (tp * hp * wp) as usize, (hp * wp) as usize, wp as usize, 1];
        // Along each dimension, input index `i` lands at `i + lead`; what falls outside the
        // copy (a negative lead's first rows, rows past what the output reads) is not copied.
        let span = |lead: i64, from: i64, count: i64, extent: i64| {
            let first = from.max(-lead);
            let end = (from + count).min(extent - lead);
            (first, (end - first).max(0))
        };
        let (h0, rows) = span(lead[1], 0, g.h as i64, hp);
        let (w0, cols) = span(lead[2], 0, g.w as i64, wp);
        // Frames: `front`'s, then `self`'s, as one sequence along time.
        let ft = front.map_or(0, |(_, ft)| ft as i64);
        let parts = front.map(|(f, _)| (f, 0, ft)).into_iter().chain([(self, ft, g.t as i64 - ft)]);
        for (part, start, frames) in parts {
            let (t0, fit) = span(lead[0], start, frames, tp);
            if fit == 0 || rows == 0 || cols == 0 {
                continue;
            }
            let plane = (g.h * g.w) as usize;
            let src = [c * frames as usize * plane, frames as usize * plane, plane, g.w as usize, 1];
            let src_offset = ((t0 - start) as usize * g.h as usize + h0 as usize) * g.w as usize + w0 as usize;
            let dst_offset = (((t0 + lead[0]) * hp + h0 + lead[1]) * wp + w0 + lead[2]) as usize;
            let extent = [n, c, fit as usize, rows as usize, cols as usize];
            part.copy_box_into(&src, src_offset, &mut padded, &dst, dst_offset, &extent)?;
        }
        Ok((Some(padded), ext, [0; 3]))
    }

    /// The convolution on cuDNN with `algorithm`, or cuDNN's first admissible candidate
    /// (`None`). The arguments were checked by `conv3d`.
    pub(super) fn conv3d_cudnn(
        &self,
        front: Option<(&Self, u64)>,
        weight: &Self,
        bias: Option<&Self>,
        g: ConvGeom,
        algorithm: Option<u32>,
    ) -> Result<Self> {
        let ft = front.map_or(0, |(_, ft)| ft);
        let frame = (g.n * g.cin * g.h * g.w) as usize;
        let lens = [
            (self.len, frame * (g.t - ft.min(g.t)) as usize),
            (weight.len, (g.cout * g.cin * g.kt * g.kh * g.kw) as usize),
        ];
        let front_len = front.map(|(f, _)| (f.len, frame * ft as usize));
        let bias_len = bias.map(|b| (b.len, g.cout as usize));
        if let Some((have, want)) = lens.into_iter().chain(front_len).chain(bias_len).find(|(have, want)| have != want)
        {
            return Err(TensorError::InvalidArgument {
                op: "conv3d (cuDNN)",
                reason: format!("an operand of {have} elements where {g:?} needs {want}"),
            });
        }
        let (padded, [t, h, w], pads) = self.padded_input(front, &g)?;
        let input = padded.as_ref().unwrap_or(self);
        let problem = problem(&g, self.dtype(), [t, h, w], pads)?;
        let ordinal = self.device.ordinal;
        let d = Descriptors::new(ordinal, &problem)?;
        let offered = d.candidates(cudnn::thread_handle(&self.device)?)?;
        let algorithm = match algorithm {
            Some(a) => a,
            None => {
                let key = LayerKey::of(&g, front.is_some(), self.dtype(), problem.tf32);
                let forced = conv_choice::forced_for(&self.device.name, key, || {
                    preferred(&offered)
                        .map(|c| ConvChoice::Cudnn(c.algorithm))
                        .ok_or_else(|| none_admitted(&problem, &offered))
                })?;
                match forced {
                    ConvChoice::Cudnn(a) => a,
                    ConvChoice::Ours => return Err(none_admitted(&problem, &offered)),
                }
            }
        };
        let chosen = admissible(&offered).into_iter().find(|c| c.algorithm == algorithm).ok_or_else(|| {
            TensorError::InvalidArgument {
                op: "conv3d (cuDNN)",
                reason: format!(
                    "cuDNN does not offer algorithm {algorithm}, chosen for this layer, for {problem:?} (offered: \
                     {offered:?})"
                ),
            }
        })?;
        let bf16_bias;
        let bias = match bias {
            // cuDNN adds a bias of the output's type: a bf16 model's biases are bf16 values.
            Some(b) if self.dtype() == DType::BF16 => {
                bf16_bias = crate::backend::DeviceElementwise::to_dtype(b, DType::BF16)?;
                Some(&bf16_bias)
            }
            other => other,
        };
        let mut workspace = match chosen.workspace {
            0 => None,
            bytes => Some(self.device.alloc_zeros::<u8>(bytes)?),
        };
        let mut out = self.output((g.n * g.cout * g.to * g.ho * g.wo) as usize)?;
        {
            let (x, wv) = (input.data.view(0), weight.data.view(0));
            let b = bias.as_ref().map(|b| b.data.view(0));
            let mut y = out.data.view_mut(0);
            let ops = Operands { x: &x, w: &wv, bias: b.as_ref(), y: &mut y, workspace: workspace.as_mut() };
            cudnn::forward(&self.device, &d, chosen.algorithm, ops)?;
        }
        Ok(out)
    }

    /// The convolution on what the per-shape table says for this shape on this device (timing
    /// ours against cuDNN's admissible algorithms the first time, see [`conv_choice`]).
    pub(super) fn conv3d_fastest(
        &self,
        front: Option<(&Self, u64)>,
        weight: &Self,
        bias: Option<&Self>,
        g: ConvGeom,
    ) -> Result<Self> {
        let math = TensorCoreMath::for_conv(self.dtype());
        let key = LayerKey::of(&g, front.is_some(), self.dtype(), math == TensorCoreMath::Tf32);
        let choice = conv_choice::choice_for(&self.device.name, key, || self.time_candidates(front, weight, bias, g))?;
        match choice {
            ConvChoice::Ours => self.conv3d_ours(front, weight, bias, g),
            ConvChoice::Cudnn(a) => self.conv3d_cudnn(front, weight, bias, g, Some(a)),
        }
    }

    /// Times ours and each admissible cuDNN algorithm on these operands (one warm-up run, then
    /// one timed run each, the device idle before and after) and returns the fastest. A cuDNN
    /// candidate that fails (or a problem cuDNN cannot be asked) is left out with a warning:
    /// the user's convolution fails only when ours does, and ours is the choice when no cuDNN
    /// candidate ran.
    fn time_candidates(
        &self,
        front: Option<(&Self, u64)>,
        weight: &Self,
        bias: Option<&Self>,
        g: ConvGeom,
    ) -> Result<ConvChoice> {
        let time = |run: &dyn Fn() -> Result<Self>| -> Result<f64> {
            drop(run()?);
            self.device.synchronize()?;
            let start = Instant::now();
            drop(run()?);
            self.device.synchronize()?;
            Ok(start.elapsed().as_secs_f64())
        };
        let ours = time(&|| self.conv3d_ours(front, weight, bias, g))?;
        let ([t, h, w], pads) = match (front, symmetric_pads(&g)) {
            (None, Some(pads)) => ([g.t, g.h, g.w], pads),
            _ => (padded_extents(&g), [0; 3]),
        };
        let offered = problem(&g, self.dtype(), [t, h, w], pads).and_then(|problem| {
            let d = Descriptors::new(self.device.ordinal, &problem)?;
            d.candidates(cudnn::thread_handle(&self.device)?)
        });
        let allowed = match offered {
            Ok(offered) => admissible(&offered),
            Err(e) => {
                tracing::warn!(device = %self.device.name, ?g, error = %e, "cuDNN not timed for this convolution; ours runs");
                Vec::new()
            }
        };
        let algorithms: Vec<u32> = allowed.iter().map(|c| c.algorithm).collect();
        let timed = time_each(&algorithms, |a| time(&|| self.conv3d_cudnn(front, weight, bias, g, Some(a))));
        let choice = conv_choice::fastest(ours, &timed);
        tracing::info!(device = %self.device.name, ?g, ours, ?timed, %choice, "convolution timed");
        Ok(choice)
    }
}

#[cfg(test)]
mod tests {
    use super::{problem, symmetric_pads, time_each};
    use crate::abi::ConvGeom;
    use crate::cuda::backend::conv_choice::{ConvChoice, fastest};
    use crate::{DType, TensorError};

    fn geom(h: u64, k: u64, s: u64, o: u64, p: i64) -> ConvGeom {
        ConvGeom {
            n: 1,
            cin: 4,
            t: 1,
            h,
            w: h,
            cout: 8,
            kt: 1,
            kh: k,
            kw: k,
            to: 1,
            ho: o,
            wo: o,
            stride_t: 1,
            stride: s,
            pad_front: 0,
            pad_top: p,
            pad_left: p,
        }
    }

    #[test]
    fn cudnn_reads_in_place_only_padding_it_can_express() {
        // A 3x3 "same" conv and a 1x1: in place.
        assert_eq!(symmetric_pads(&geom(9, 3, 1, 9, 1)), Some([0, 1, 1]));
        assert_eq!(symmetric_pads(&geom(9, 1, 1, 9, 0)), Some([0, 0, 0]));
        // Stride 2, padded bottom/right only (diffusers' downsample): cuDNN would give 5, not 6.
        assert_eq!(symmetric_pads(&geom(12, 3, 2, 6, 0)), None);
        // Stride 2 with one row each side: 13 -> 7 both ways.
        assert_eq!(symmetric_pads(&geom(13, 3, 2, 7, 1)), Some([0, 1, 1]));
        // Wan's causal time padding (two frames in front, none after): a copy.
        let causal = ConvGeom { t: 3, kt: 3, to: 3, pad_front: 2, ..geom(9, 3, 1, 9, 1) };
        assert_eq!(symmetric_pads(&causal), None);
        assert_eq!(symmetric_pads(&geom(9, 3, 1, 9, -1)), None);
    }

    #[test]
    fn operands_past_cudnns_int_are_refused_though_each_extent_fits() {
        // A 512-channel 4096x4096 "same" conv: every extent fits an int, the 2^33 elements do not.
        let big = ConvGeom { cin: 512, cout: 512, ..geom(4096, 3, 1, 4096, 1) };
        let err = problem(&big, DType::F32, [1, 4096, 4096], [0, 1, 1]).unwrap_err();
        assert!(matches!(err, TensorError::InvalidArgument { op: "conv3d (cuDNN)", .. }), "{err}");
        assert!(err.to_string().contains("32-bit int"), "{err}");
        // The same layer at 64x64 is asked as is.
        let small = ConvGeom { cin: 512, cout: 512, ..geom(64, 3, 1, 64, 1) };
        let p = problem(&small, DType::F32, [1, 64, 64], [0, 1, 1]).unwrap();
        assert_eq!(p.x, [1, 512, 1, 64, 64]);
    }

    #[test]
    fn a_failing_cudnn_candidate_is_left_out_and_none_left_means_ours() {
        let fail = |a: u32| TensorError::InvalidArgument { op: "test", reason: format!("algorithm {a}") };
        let timed = time_each(&[0, 1, 6], |a| if a == 1 { Err(fail(a)) } else { Ok(a as f64 + 1.0) });
        assert_eq!(timed, [(0, 1.0), (6, 7.0)]);
        assert_eq!(fastest(2.0, &timed), ConvChoice::Cudnn(0));
        let none = time_each(&[0, 1], |a| Err(fail(a)));
        assert!(none.is_empty());
        assert_eq!(fastest(2.0, &none), ConvChoice::Ours);
    }
}
