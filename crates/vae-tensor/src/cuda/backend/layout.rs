//! Launchers of `kernels-cu/layout.cu`: nearest upsample, strided box copies (narrow, cat,
//! permute, halos), Wan2.2's DupUp3D / AvgDown3D.

use cudarc::driver::PushKernelArg;

use super::super::kernels::{self, Typed};
use super::storage::{CudaData, CudaStorage, elementwise};
use crate::abi::Box8;
use crate::backend::{DeviceLayout, DeviceStore};
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
        let f = self.kernel(kernels::UPSAMPLE_NEAREST)?;
        let (p, hh, ww, k) = (planes as u64, h as u64, w as u64, factor as u64);
        unsafe {
            self.device
                .stream()
                .launch_builder(&f)
                .arg(&self.data)
                .arg(&mut out.data)
                .arg(&p)
                .arg(&hh)
                .arg(&ww)
                .arg(&k)
                // 32 lanes per input row (see layout.cu).
                .launch(self.device.streaming(planes * h * 32))
        }
        .map_err(self.err("upsample_nearest2d"))?;
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
        let f = self.kernel(kernels::COPY_BOX)?;
        let total = n as u64;
        let stream = &self.device.stream();
        let launched = match (&self.data, &mut dst.data) {
            (CudaData::F32(s), CudaData::F32(d)) => {
                let (src, mut dst) = (s.slice(src_offset..), d.slice_mut(dst_offset..));
                unsafe { stream.launch_builder(&f).arg(&src).arg(&mut dst).arg(&b).arg(&total).launch(cfg) }
            }
            (CudaData::Bf16(s), CudaData::Bf16(d)) => {
                let (src, mut dst) = (s.slice(src_offset..), d.slice_mut(dst_offset..));
                unsafe { stream.launch_builder(&f).arg(&src).arg(&mut dst).arg(&b).arg(&total).launch(cfg) }
            }
            _ => return Err(TensorError::InvalidArgument { op: "copy_box", reason: "operand types differ".into() }),
        };
        launched.map_err(self.err("copy_box"))?;
        Ok(())
    }

    /// Wan2.2's `DupUp3D` (see `layout.cu`): `dims` = `[batch, channels, t, h, w]`,
    /// `[out_channels, ft, fs, repeats, drop]`.
    fn dup_up3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        self.layout_kernel(kernels::DUP_UP3D, dims, params, out_len)
    }

    /// Wan2.2's `AvgDown3D` (see `layout.cu`): `dims` = `[batch, channels, t, h, w]`,
    /// `[out_channels, ft, fs, group, pad_t]`.
    fn avg_down3d(&self, dims: [usize; 5], params: [usize; 5], out_len: usize) -> Result<Self> {
        self.layout_kernel(kernels::AVG_DOWN3D, dims, params, out_len)
    }
}

impl CudaStorage {
    /// A `layout.cu` kernel taking `(x, out, five dims, five parameters)` as u64s.
    pub(super) fn layout_kernel(
        &self,
        kernel: Typed,
        dims: [usize; 5],
        params: [usize; 5],
        out_len: usize,
    ) -> Result<Self> {
        let mut out = self.like(out_len)?;
        let kernel = kernel.of(self.dtype());
        let f = self.device.function(kernel)?;
        let args: Vec<u64> = dims.iter().chain(&params).map(|&v| v as u64).collect();
        let stream = self.device.stream();
        let mut launch = stream.launch_builder(&f);
        launch.arg(&self.data).arg(&mut out.data);
        for a in &args {
            launch.arg(a);
        }
        unsafe { launch.launch(elementwise(out_len)) }.map_err(self.err(kernel.name))?;
        Ok(out)
    }
}
