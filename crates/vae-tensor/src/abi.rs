//! The by-value kernel arguments of `kernels-cu/`, in the C layout the kernels declare. One
//! definition for the backend and for anyone launching the embedded kernels directly (the
//! kernel-level GPU tests).

/// `ConvGeom` of `conv.cu`: the input `[n, cin, t, h, w]`, the kernel `[cout, cin, kt, kh, kw]`,
/// the output extents, strides, and the front / top / left padding (back, bottom and right
/// padding follow from the output extents).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
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
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::DeviceRepr for ConvGeom {}

impl ConvGeom {
    /// The 1x1 convolution of one row of `pixels` pixels of `channels` channels into `outs`
    /// outputs: the product `out[o][p] = Σ_c w[o][c] · x[p][c]` on the convolution kernels (the
    /// tensor-core attention's two products).
    pub fn pointwise(outs: u64, pixels: u64, channels: u64) -> Self {
        Self {
            n: 1,
            cin: channels,
            t: 1,
            h: 1,
            w: pixels,
            cout: outs,
            kt: 1,
            kh: 1,
            kw: 1,
            to: 1,
            ho: 1,
            wo: pixels,
            stride_t: 1,
            stride: 1,
            ..Self::default()
        }
    }

    /// The zero-padded channels-last copy of the input that the tensor-core convolution reads
    /// (`padded_of` in conv.cu), for elements of `elem_bytes` (4: f32, 2: bf16): frames, rows
    /// and columns with the padding materialised, and the channels rounded up to a whole
    /// 16-byte chunk. Output extents must be non-zero.
    pub fn channels_last(&self, elem_bytes: u64) -> ChannelsLast {
        let chunk = 16 / elem_bytes;
        ChannelsLast {
            t: (self.to - 1) * self.stride_t + self.kt,
            h: (self.ho - 1) * self.stride + self.kh,
            w: (self.wo - 1) * self.stride + self.kw,
            c: self.cin.div_ceil(chunk) * chunk,
        }
    }
}

/// Extents of a convolution's padded channels-last input `[n, t, h, w, c]` (see
/// [`ConvGeom::channels_last`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)] // the extents, named as the dimensions
pub struct ChannelsLast {
    pub t: u64,
    pub h: u64,
    pub w: u64,
    pub c: u64,
}

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
#[cfg(feature = "cuda")]
unsafe impl cudarc::driver::DeviceRepr for Box8 {}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_channels_last_copy_materialises_the_padding_and_rounds_channels_to_a_chunk() {
        // Wan's causal 3x3x3 conv (two frames in front, one row / column each side) on 20
        // channels: 3 output frames of 9x11 read 5 frames of 11x13.
        let causal = ConvGeom {
            n: 1,
            cin: 20,
            t: 3,
            h: 9,
            w: 11,
            cout: 8,
            kt: 3,
            kh: 3,
            kw: 3,
            to: 3,
            ho: 9,
            wo: 11,
            stride_t: 1,
            stride: 1,
            pad_front: 2,
            pad_top: 1,
            pad_left: 1,
        };
        assert_eq!(causal.channels_last(2), ChannelsLast { t: 5, h: 11, w: 13, c: 24 });
        assert_eq!(causal.channels_last(4), ChannelsLast { t: 5, h: 11, w: 13, c: 20 });
        // A stride-2 3x3 downsample of 12x10 (padded bottom and right): 6x5 outputs read 13x11.
        let down = ConvGeom {
            cin: 5,
            t: 1,
            h: 12,
            w: 10,
            kt: 1,
            to: 1,
            ho: 6,
            wo: 5,
            stride: 2,
            pad_front: 0,
            pad_top: 0,
            pad_left: 0,
            ..causal
        };
        assert_eq!(down.channels_last(4), ChannelsLast { t: 1, h: 13, w: 11, c: 8 });
    }

    #[test]
    fn a_pointwise_product_reads_its_operands_unpadded() {
        // Attention's scores over 6240 keys of 384 channels: the keys' rows as they are.
        let g = ConvGeom::pointwise(6240, 6240, 384);
        assert_eq!((g.cout, g.cin, g.to * g.ho * g.wo), (6240, 384, 6240));
        assert_eq!(g.channels_last(2), ChannelsLast { t: 1, h: 1, w: 6240, c: 384 });
        assert_eq!((g.pad_front, g.pad_top, g.pad_left), (0, 0, 0));
    }
}
