//! The convolution, on `kernels-cu/conv.cu` and `conv_sm90a.cu`: the channels-last copies of input
//! and weights, then the product on the kernel [`super::select`] chooses; or on cuDNN
//! ([`super::conv_cudnn`]) where the calling thread or the process asks for it
//! ([`super::select::conv_route`]).

use cudarc::driver::LaunchConfig;

use super::conv_choice::{ConvChoice, LayerKey, agreed_choice};
use super::select::{ConvKernel, ConvRoute, TensorCoreMath, conv_kernel, conv_route};
use super::storage::{CudaStorage, elementwise};
use crate::abi::{ChannelsLast, ConvGeom};
use crate::backend::{DeviceConv, DeviceStore};
use crate::kernel_args::{ConvInput, ConvInputSplit, ConvProduct, ConvWeight};
use crate::{DType, Result, TensorError};

impl DeviceConv for CudaStorage {
    /// The convolution (2-D convs are one frame, one temporal tap) on tensor cores, in three
    /// launches: the input into a zero-padded channels-last buffer `[N, Tp, Hp, Wp, Cp]`
    /// (channels rounded up to a 16-byte chunk), the weights into `[Cout, kt, kh, kw, Cp]`, then
    /// the implicit GEMM, whose K loop reads 64 contiguous bytes per pixel and tap with no bounds
    /// checks (`conv3d_tc_*` in conv.cu). bf16 multiplies on bf16 tensor cores; f32 on TF32
    /// tensor cores with each operand split in two TF32 parts (three products: f32 accuracy).
    /// Accumulation is f32 and the bias is f32 in both; the tile height is chosen by
    /// [`tensor_core_tile`].
    ///
    /// With `front = Some((f, ft))` the input is `f` (`ft` frames) followed by `self` along time,
    /// `g.t` frames in all: the conv of their concatenation, whose frames the channels-last copy
    /// reads from both (`conv_input_channels_last_split_*`) instead of a copy of the whole.
    fn conv3d(&self, front: Option<(&Self, u64)>, weight: &Self, bias: Option<&Self>, g: ConvGeom) -> Result<Self> {
        self.same_dtype("conv3d", &[weight])?;
        if let Some((f, _)) = front {
            self.same_dtype("conv3d", &[f])?;
        }
        if let Some(b) = bias {
            Self::f32_param("conv3d", b)?;
        }
        let len = (g.n * g.cout * g.to * g.ho * g.wo) as usize;
        if len == 0 {
            return self.like(0);
        }
        let route = conv_route();
        if route == ConvRoute::Ours {
            return self.conv3d_ours(front, weight, bias, g);
        }
        match super::cudnn::library() {
            Ok(_) if route == ConvRoute::Cudnn => self.conv3d_cudnn(front, weight, bias, g, None),
            Ok(_) => self.conv3d_fastest(front, weight, bias, g),
            Err(why) => {
                // Under rank 0's decision, ours in place of cuDNN would give other bits than
                // the ranks that load it: refused.
                if super::conv_choice::agreed_route().is_some() {
                    let tf32 = TensorCoreMath::for_conv(self.dtype()) == TensorCoreMath::Tf32;
                    let key = LayerKey::of(&g, front.is_some(), self.dtype(), tf32);
                    if route == ConvRoute::Cudnn || agreed_choice(&key) != Some(ConvChoice::Ours) {
                        return Err(TensorError::InvalidArgument {
                            op: "conv3d",
                            reason: format!(
                                "rank 0 of this group runs this convolution on cuDNN, but {why}: refused, as ours would \
                                 give other bits"
                            ),
                        });
                    }
                }
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| tracing::warn!("cuDNN convolutions were asked for, but {why}: ours run instead"));
                self.conv3d_ours(front, weight, bias, g)
            }
        }
    }
}

impl CudaStorage {
    /// Our tensor-core convolution (see `DeviceConv::conv3d`); the arguments' types were checked.
    pub(super) fn conv3d_ours(
        &self,
        front: Option<(&Self, u64)>,
        weight: &Self,
        bias: Option<&Self>,
        g: ConvGeom,
    ) -> Result<Self> {
        let len = (g.n * g.cout * g.to * g.ho * g.wo) as usize;
        let bf16 = self.dtype() == DType::BF16;
        let ChannelsLast { t: tp, h: hp, w: wp, c: cp } = g.channels_last(if bf16 { 2 } else { 4 });
        let taps = g.kt * g.kh * g.kw;
        let cols = g.n * g.to * g.ho * g.wo;
        let rows_padded = g.n * tp * hp;
        // The K loop counts slices and places channels in 32-bit arithmetic; offsets are 64-bit.
        if taps * cp + 64 > u32::MAX as u64 || [tp, hp, wp].iter().any(|&e| e >= i32::MAX as u64) {
            return Err(TensorError::InvalidArgument {
                op: "conv3d",
                reason: format!(
                    "{taps} taps of {cp} channels or extents {:?} exceed the kernels' 32-bit range",
                    [tp, hp, wp]
                ),
            });
        }
        let math = TensorCoreMath::for_conv(self.dtype());
        let elem = if bf16 { 2 } else { 4 };
        let kernel = conv_kernel(math, g.cout, taps * cp, elem, cols, self.device.sms as u64, self.device.wgmma);
        let row_tiles = match kernel {
            ConvKernel::TensorCores(tile) => g.cout.div_ceil(tile.rows),
            ConvKernel::Wgmma(tile) => g.cout.div_ceil(tile.channels),
            ConvKernel::SmallCout => 1,
        };
        if rows_padded > i32::MAX as u64
            || wp.div_ceil(64) > 65_535
            || cp.div_ceil(32) > 65_535
            || cols.div_ceil(128) > i32::MAX as u64
            || row_tiles > 65_535
        {
            return Err(TensorError::InvalidArgument { op: "conv3d", reason: "too large for one launch".into() });
        }
        // The three kernels write every element of their outputs (the padding as zeros).
        let mut padded = self.output((rows_padded * wp * cp) as usize)?;
        let cfg = LaunchConfig {
            grid_dim: (rows_padded as u32, wp.div_ceil(64) as u32, cp.div_ceil(32) as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let launched = match front {
            None => {
                let copy = ConvInput { x: self.data.view(0), xp: padded.data.view_mut(0), g };
                copy.launch(&self.device, cfg)
            }
            Some((front, front_t)) => {
                let (front, x, xp) = (front.data.view(0), self.data.view(0), padded.data.view_mut(0));
                ConvInputSplit { front, front_t, x, xp, g }.launch(&self.device, cfg)
            }
        };
        launched.map_err(self.err("conv3d"))?;
        let weight_len = (g.cout * taps * cp) as usize;
        let mut reordered = self.output(weight_len)?;
        let copy = ConvWeight { w: weight.data.view(0), wr: reordered.data.view_mut(0), g };
        copy.launch(&self.device, elementwise(weight_len)).map_err(self.err("conv3d"))?;

        let mut out = self.output(len)?;
        let (grid_dim, shared_mem_bytes) = match kernel {
            ConvKernel::SmallCout => ((cols.div_ceil(256).min(self.device.sms as u64 * 8) as u32, 1, 1), 0),
            ConvKernel::TensorCores(tile) => (tile.grid(cols, g.cout), tile.dynamic_shared_bytes()),
            ConvKernel::Wgmma(tile) => (tile.grid(cols, g.cout), tile.dynamic_shared_bytes()),
        };
        let cfg = LaunchConfig { grid_dim, block_dim: (256, 1, 1), shared_mem_bytes };
        let product = ConvProduct {
            xp: padded.data.view(0),
            wr: reordered.data.view(0),
            bias: bias.map(|b| b.data.view(0)),
            out: out.data.view_mut(0),
            g,
        };
        product.launch(kernel, &self.device, cfg).map_err(self.err("conv3d"))?;
        Ok(out)
    }
}
