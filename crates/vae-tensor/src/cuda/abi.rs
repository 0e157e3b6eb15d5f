//! The by-value kernel arguments of `kernels-cu/`, in the C layout the kernels declare. One
//! definition for the backend and for anyone launching the embedded kernels directly (the
//! kernel-level GPU tests).

use cudarc::driver::DeviceRepr;

/// `ConvGeom` of `conv.cu`: the input `[n, cin, t, h, w]`, the kernel `[cout, cin, kt, kh, kw]`,
/// the output extents, strides, and the front / top / left padding (back, bottom and right
/// padding follow from the output extents).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)] // the fields are named as in conv.cu
pub struct ConvGeom {
    pub n: u64,
    pub cin: u64,
    pub t: u64,
    pub h: u64,
    pub w: u64,
    pub cout: u64,
    pub kt: u64,
    pub kh: u64,
    pub kw: u64,
    pub to: u64,
    pub ho: u64,
    pub wo: u64,
    pub stride_t: u64,
    pub stride: u64,
    pub pad_front: i64,
    pub pad_top: i64,
    pub pad_left: i64,
}

// SAFETY: plain integers in C layout, as `conv.cu` declares the struct.
unsafe impl DeviceRepr for ConvGeom {}

/// `Box8` of `layout.cu`: a box of up to 8 dimensions (`extent`, row-major), read and written
/// through element strides.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Box8 {
    /// Extents; unused trailing entries 1.
    pub extent: [u64; 8],
    /// Source strides, in elements.
    pub src_stride: [i64; 8],
    /// Destination strides, in elements.
    pub dst_stride: [i64; 8],
    /// Dimensions used.
    pub rank: i32,
}

// SAFETY: as above.
unsafe impl DeviceRepr for Box8 {}

impl Box8 {
    /// A box of `extent` (at most 8 dimensions) with the given strides.
    pub fn new(extent: &[usize], src_stride: &[usize], dst_stride: &[usize]) -> Option<Self> {
        if extent.len() > 8 || src_stride.len() != extent.len() || dst_stride.len() != extent.len() {
            return None;
        }
        let mut b = Self { extent: [1; 8], src_stride: [0; 8], dst_stride: [0; 8], rank: extent.len() as i32 };
        for d in 0..extent.len() {
            b.extent[d] = extent[d] as u64;
            b.src_stride[d] = src_stride[d] as i64;
            b.dst_stride[d] = dst_stride[d] as i64;
        }
        Some(b)
    }
}
