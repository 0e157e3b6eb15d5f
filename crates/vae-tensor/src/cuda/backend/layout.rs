//! The ops of `kernels-cu/layout.cu`: nearest upsample, strided box copies (narrow, cat,
//! permute, halos), Wan2.2's DupUp3D / AvgDown3D.

use super::super::kernels;
use super::storage::{CudaStorage, elementwise};
use crate::abi::Box8;
use crate::backend::{DeviceLayout, DeviceStore};
use crate::kernel_args::{AvgDown3d, CopyBox, DupUp3d, UpsampleNearest};
use crate::{Result, TensorError};

/// The same box copy with fewer dimensions (`copy_box` in layout.cu walks rows of the last one):
/// dimensions of extent 1 dropped, and each dimension merged into the next where both source and
/// destination step over it as over one longer row. At least one dimension remains. `extent`
/// holds no zero (the caller returns first).
pub(super) fn merged_box(extent: &[usize], src: &[usize], dst: &[usize]) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    if src.len() != extent.len() || dst.len() != extent.len() {
        return (extent.to_vec(), src.to_vec(), dst.to_vec()); // refused by `Box8::new`
    }
    let (mut e, mut s, mut d): (Vec<usize>, Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..extent.len() {
        if extent[k] == 1 {
            continue;
        }
        match e.len().checked_sub(1) {
            Some(j) if s[j] == src[k] * extent[k] && d[j] == dst[k] * extent[k] => {
                e[j] *= extent[k];
                s[j] = src[k];
                d[j] = dst[k];
            }
            _ => {
                e.push(extent[k]);
                s.push(src[k]);
                d.push(dst[k]);
            }
        }
    }
    if e.is_empty() { (vec![1], vec![0], vec![0]) } else { (e, s, d) }
}

/// `COPY_SEGMENT` of layout.cu: the longest piece of a row one group of 32 lanes copies.
pub(super) const COPY_SEGMENT: usize = 2048;

impl DeviceLayout for CudaStorage {
    /// Nearest upsampling of the last two dimensions of `planes` planes of `h × w`.
    fn upsample_nearest2d(&self, planes: usize, h: usize, w: usize, factor: usize) -> Result<Self> {
        let len = planes * h * w * factor * factor;
        let mut out = self.output(len)?;
        // 32 lanes per input row (see layout.cu).
        let cfg = self.device.streaming(planes * h * 32);
        let (planes, h, w, f) = (planes as u64, h as u64, w as u64, factor as u64);
        let upsample = UpsampleNearest { x: self.data.view(0), out: out.data.view_mut(0), planes, h, w, f };
        upsample.launch(&self.device, cfg).map_err(self.err("upsample_nearest2d"))?;
        Ok(out)
    }

    /// Copies a box of `extent` at `src_offset` (row-major `src_dims`) into `dst` at
    /// `dst_offset` (row-major `dst_dims`): narrow, cat, permute (with permuted strides).
    fn copy_box_into(
        &self,
        src_strides: &[usize],
        src_offset: usize,
        dst: &mut Self,
        dst_strides: &[usize],
        dst_offset: usize,
        extent: &[usize],
    ) -> Result<()> {
        let n: usize = extent.iter().product();
        if n == 0 {
            return Ok(());
        }
        let (extent, src_strides, dst_strides) = merged_box(extent, src_strides, dst_strides);
        let b = Box8::new(&extent, &src_strides, &dst_strides).ok_or_else(|| TensorError::InvalidArgument {
            op: "copy_box",
            reason: format!("rank {} > 8 on CUDA", extent.len()),
        })?;
        // Rows of the last dimension in segments of at most 2048 elements, 32 lanes each when a
        // row is at least that long (`copy_box` in layout.cu).
        let last = extent[extent.len() - 1];
        let cfg = self.device.streaming(n / last * last.div_ceil(COPY_SEGMENT) * if last >= 32 { 32 } else { 1 });
        self.same_dtype("copy_box", &[dst])?;
        let (src, dst) = (self.data.view(src_offset), dst.data.view_mut(dst_offset));
        let copy = CopyBox { src, dst, r#box: b, n: n as u64 };
        copy.launch(&self.device, cfg).map_err(self.err("copy_box"))?;
        Ok(())
    }

    /// Wan2.2's `DupUp3D` (see `layout.cu`): `dims` = `[batch, channels, t, h, w]`,
    /// `[out_channels, ft, fs, repeats, drop]`.
    fn dup_up3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        let mut out = self.like(out_len)?;
        let [batch, channels, t, h, w] = dims.map(|v| v as u64);
        let [out_channels, ft, fs, repeats, drop] = params.map(|v| v as u64);
        let (x, out_view) = (self.data.view(0), out.data.view_mut(0));
        let up = DupUp3d { x, out: out_view, batch, channels, t, h, w, out_channels, ft, fs, repeats, drop };
        up.launch(&self.device, elementwise(out_len)).map_err(self.err(kernels::DUP_UP3D.of(self.dtype()).name))?;
        Ok(out)
    }

    /// Wan2.2's `AvgDown3D` (see `layout.cu`): `dims` = `[batch, channels, t, h, w]`,
    /// `[out_channels, ft, fs, group, pad_t]`.
    fn avg_down3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        let mut out = self.like(out_len)?;
        let [batch, channels, t, h, w] = dims.map(|v| v as u64);
        let [out_channels, ft, fs, group, pad_t] = params.map(|v| v as u64);
        let (x, out_view) = (self.data.view(0), out.data.view_mut(0));
        let down = AvgDown3d { x, out: out_view, batch, channels, t, h, w, out_channels, ft, fs, group, pad_t };
        down.launch(&self.device, elementwise(out_len)).map_err(self.err(kernels::AVG_DOWN3D.of(self.dtype()).name))?;
        Ok(out)
    }
}
