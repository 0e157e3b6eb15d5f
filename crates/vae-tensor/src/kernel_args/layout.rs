//! `kernels-cu/layout.cu`: nearest upsampling, strided box copies, Wan2.2's `DupUp3D` and
//! `AvgDown3D`. All grid-stride: any launch shape is correct, and the extents bound every
//! access.

use cudarc::driver::LaunchConfig;

use super::{
    Instance, LaunchError, enqueue, holds, holds_offsets, kernel_args, product, reach, require, select, typed,
};
use crate::cuda::backend::CudaDevice;
use crate::cuda::kernels;

pub(super) const UPSAMPLE_NEAREST: [Instance; 2] = typed(kernels::UPSAMPLE_NEAREST);
pub(super) const COPY_BOX: [Instance; 2] = typed(kernels::COPY_BOX);
pub(super) const DUP_UP3D: [Instance; 2] = typed(kernels::DUP_UP3D);
pub(super) const AVG_DOWN3D: [Instance; 2] = typed(kernels::AVG_DOWN3D);

kernel_args! {
    /// `upsample_nearest2d_*`: the last two dimensions of `planes` planes of `h × w`, each
    /// element repeated `f × f` times.
    struct UpsampleNearest<'a> {
        x: [const T*],
        out: [T*],
        planes: [u64],
        h: [u64],
        w: [u64],
        f: [u64],
    }

    /// `copy_box_*`: the `n` elements of a strided box (`copy_box_u16` moves bf16 as its bits).
    struct CopyBox<'a> {
        src: [const T*],
        dst: [T*],
        r#box: [Box8],
        n: [u64],
    }

    /// `dup_up3d_*`: `out[b, o, t·ft + dt − drop, y·fs + dy, x·fs + dx] = x[b, j / repeats, t, y,
    /// x]` with `j = ((o·ft + dt)·fs + dy)·fs + dx`, the first `drop` output frames skipped.
    struct DupUp3d<'a> {
        x: [const T*],
        out: [T*],
        batch: [u64],
        channels: [u64],
        t: [u64],
        h: [u64],
        w: [u64],
        out_channels: [u64],
        ft: [u64],
        fs: [u64],
        repeats: [u64],
        drop: [u64],
    }

    /// `avg_down3d_*`: `pad_t` zero frames in front, each `ft × fs × fs` block folded into
    /// channels and groups of `group` folded channels averaged.
    struct AvgDown3d<'a> {
        x: [const T*],
        out: [T*],
        batch: [u64],
        channels: [u64],
        t: [u64],
        h: [u64],
        w: [u64],
        out_channels: [u64],
        ft: [u64],
        fs: [u64],
        group: [u64],
        pad_t: [u64],
    }
}

impl UpsampleNearest<'_> {
    /// Queues the upsampling on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &UPSAMPLE_NEAREST)?;
        let k = instance.kernel;
        holds(k, "x", self.x.len(), product(&[self.planes, self.h, self.w]))?;
        holds(k, "out", self.out.len(), product(&[self.planes, self.h, self.f, self.w, self.f]))?;
        let f = device.function(k)?;
        // SAFETY: `instance` is the instantiation of the operands' storage type, `f` its entry
        // point, and `Self` declares its parameters (signature test, against layout.cu).
        // Grid-stride over input rows `r < planes · h` (32 lanes each), it reads `x[r · w + i]`
        // for `i < w` and writes `out[(r · f + dy) · w · f + i · f + dx]` for `dy, dx < f`: inside
        // both (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl CopyBox<'_> {
    /// Queues the copy on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &COPY_BOX)?;
        let (k, b) = (instance.kernel, self.r#box);
        let rank = usize::try_from(b.rank).ok().filter(|&r| r <= 8);
        let rank = rank.ok_or_else(|| super::invalid(k, format!("a box of rank {}", b.rank)))?;
        let extent = &b.extent[..rank];
        require(k, extent.iter().all(|&e| e > 0) && product(extent) == Some(self.n), || {
            format!("{} elements in a box of {extent:?}", self.n)
        })?;
        holds_offsets(k, "src", self.src.len(), reach(extent, &b.src_stride[..rank]))?;
        holds_offsets(k, "dst", self.dst.len(), reach(extent, &b.dst_stride[..rank]))?;
        let f = device.function(k)?;
        // SAFETY: `instance` is the instantiation of the operands' storage type, `f` its entry
        // point, and `Self` declares its parameters (signature test). The kernel reads the box's
        // rank (at most 8: checked) and walks rows of its last dimension: an element's index in
        // every other dimension is taken modulo that dimension's extent (none zero: checked) and
        // its index in the last stays below the extent, so each offset is `Σ idx_d · stride_d`
        // with `idx_d < extent_d`, between the lowest and highest offsets checked inside `src`
        // and `dst`.
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl DupUp3d<'_> {
    /// Queues the upsampling on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &DUP_UP3D)?;
        let k = instance.kernel;
        let (ft, fs) = (self.ft, self.fs);
        let frames = self.t.checked_mul(ft).and_then(|f| f.checked_sub(self.drop));
        // The folded output channels read, against the input channels' repeats (`None`: 2^64 or
        // more).
        let fits = match (product(&[self.out_channels, ft, fs, fs]), self.channels.checked_mul(self.repeats)) {
            (Some(folded), Some(repeated)) => folded <= repeated,
            (folded, _) => folded.is_some(),
        };
        let ok = ft > 0 && fs > 0 && self.repeats > 0 && frames.is_some();
        require(k, ok && fits, || {
            format!(
                "{} channels x {} repeats into {} by {ft}x{fs}x{fs}",
                self.channels, self.repeats, self.out_channels
            )
        })?;
        let frames = frames.unwrap_or(0);
        holds(k, "x", self.x.len(), product(&[self.batch, self.channels, self.t, self.h, self.w]))?;
        let out = [self.batch, self.out_channels, frames, self.h, fs, self.w, fs];
        holds(k, "out", self.out.len(), product(&out))?;
        let f = device.function(k)?;
        // SAFETY: `instance` is the instantiation of the operands' storage type, `f` its entry
        // point, and `Self` declares its parameters (signature test). Grid-stride over the
        // `batch · out_channels · (t · ft − drop) · h·fs · w·fs` outputs (`drop ≤ t · ft`:
        // checked), it writes each once and reads channel `j / repeats` of `x` with `j <
        // out_channels · ft · fs²  ≤ channels · repeats` (checked), frame `(ot + drop) / ft < t`,
        // row `oy / fs < h` and column `ox / fs < w`: inside both (checked). No divisor is zero
        // (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl AvgDown3d<'_> {
    /// Queues the downsampling on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &AVG_DOWN3D)?;
        let k = instance.kernel;
        let (ft, fs) = (self.ft, self.fs);
        // The folded input channels, against the ones the output's groups read (`None`: 2^64 or
        // more).
        let fits = match (product(&[self.channels, ft, fs, fs]), self.out_channels.checked_mul(self.group)) {
            (Some(folded), Some(read)) => folded >= read,
            (_, read) => read.is_some(),
        };
        let ok = ft > 0 && fs > 0 && self.group > 0 && self.t.checked_add(self.pad_t).is_some();
        require(k, ok && fits, || {
            format!("{} channels by {ft}x{fs}x{fs} into {} groups of {}", self.channels, self.out_channels, self.group)
        })?;
        holds(k, "x", self.x.len(), product(&[self.batch, self.channels, self.t, self.h, self.w]))?;
        let frames = (self.t + self.pad_t) / ft;
        let out = [self.batch, self.out_channels, frames, self.h / fs, self.w / fs];
        holds(k, "out", self.out.len(), product(&out))?;
        let f = device.function(k)?;
        // SAFETY: `instance` is the instantiation of the operands' storage type, `f` its entry
        // point, and `Self` declares its parameters (signature test). Grid-stride over the
        // `batch · out_channels · ⌊(t + pad_t) / ft⌋ · ⌊h / fs⌋ · ⌊w / fs⌋` outputs, it writes
        // each once and reads folded channels `k < out_channels · group ≤ channels · ft · fs²`
        // (checked), so channel `k / (ft · fs²) < channels`, frame `ot · ft + dt − pad_t < t`
        // (frames before `pad_t` skipped), row `oy · fs + dy < h`, column `ox · fs + dx < w`:
        // inside both (checked). No divisor is zero (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}
