//! Every `kernels-cu/` entry point the backend launches by name, declared once: its module (the
//! `.cu` file's stem) and its name, with the f32 and bf16 instantiations of a kernel written
//! once over the storage type side by side. The tensor-core and warpgroup-MMA convolution
//! tiles are declared with their shapes in the backend's kernel selection. A test checks every
//! name here against the embedded PTX, so a renamed kernel fails the build's tests rather than
//! its first launch.

/// One entry point of one module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kernel {
    /// The `kernels-cu/` file's stem.
    pub(crate) module: &'static str,
    /// The `extern "C"` name.
    pub(crate) name: &'static str,
}

/// A kernel written once over the storage type: its f32 and bf16 instantiations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Typed {
    /// On f32 storage.
    pub(crate) f32: Kernel,
    /// On bf16 storage.
    pub(crate) bf16: Kernel,
}

impl Typed {
    /// The instantiation for storage of `dtype`.
    pub(crate) fn of(self, dtype: crate::DType) -> Kernel {
        if dtype == crate::DType::BF16 { self.bf16 } else { self.f32 }
    }
}

macro_rules! kernels {
    (
        typed { $($(#[$td:meta])* $t:ident = $tm:literal : $tf:literal, $tb:literal;)* }
        single { $($(#[$sd:meta])* $s:ident = $sm:literal : $sn:literal;)* }
    ) => {
        $($(#[$td])* pub(crate) const $t: Typed =
            Typed { f32: Kernel { module: $tm, name: $tf }, bf16: Kernel { module: $tm, name: $tb } };)*
        $($(#[$sd])* pub(crate) const $s: Kernel = Kernel { module: $sm, name: $sn };)*
        /// Every kernel declared here.
        #[cfg(test)]
        pub(crate) const ALL: &[Kernel] = &[$($t.f32, $t.bf16,)* $($s,)*];
    };
}

kernels! {
    typed {
        /// `a + b`.
        ADD = "elementwise": "add_f32", "add_bf16";
        /// `x · mul + add`.
        AFFINE = "elementwise": "affine_f32", "affine_bf16";
        /// SiLU in place.
        SILU = "elementwise": "silu_f32", "silu_bf16";
        /// SiLU into another buffer.
        SILU_INTO = "elementwise": "silu_into_f32", "silu_into_bf16";
        /// `torch.clamp` in place.
        CLAMP = "elementwise": "clamp_f32", "clamp_bf16";
        /// Wan's channel RMS norm.
        RMS_NORM = "norm": "rms_norm_channels_f32", "rms_norm_channels_bf16";
        /// GroupNorm, first launch: chunk sums and squared deviations.
        GROUP_NORM_PARTIALS = "norm": "group_norm_partials_f32", "group_norm_partials_bf16";
        /// GroupNorm, last launch: every element.
        GROUP_NORM_APPLY = "norm": "group_norm_apply_f32", "group_norm_apply_bf16";
        /// A conv input into the padded channels-last buffer.
        CONV_INPUT = "conv": "conv_input_channels_last_f32", "conv_input_channels_last_bf16";
        /// The same, its first frames from a second tensor (the causal cache).
        CONV_INPUT_SPLIT = "conv": "conv_input_channels_last_split_f32", "conv_input_channels_last_split_bf16";
        /// Conv weights into `[Cout, kt, kh, kw, Cp]`.
        CONV_WEIGHT = "conv": "conv_weight_channels_last_f32", "conv_weight_channels_last_bf16";
        /// The convolution of at most 4 output channels on CUDA cores.
        CONV_SMALL_COUT = "conv": "conv3d_small_cout_f32_c4", "conv3d_small_cout_bf16_c4";
        /// Nearest upsampling.
        UPSAMPLE_NEAREST = "layout": "upsample_nearest2d_f32", "upsample_nearest2d_bf16";
        /// A strided box copy (bf16 moved as its bits).
        COPY_BOX = "layout": "copy_box_f32", "copy_box_u16";
        /// Wan2.2's `DupUp3D`.
        DUP_UP3D = "layout": "dup_up3d_f32", "dup_up3d_bf16";
        /// Wan2.2's `AvgDown3D`.
        AVG_DOWN3D = "layout": "avg_down3d_f32", "avg_down3d_bf16";
    }
    single {
        /// f32 → bf16, rounding to nearest even.
        CAST_F32_BF16 = "elementwise": "cast_f32_bf16";
        /// bf16 → f32, exact.
        CAST_BF16_F32 = "elementwise": "cast_bf16_f32";
        /// The RMS norm, four bf16 pixels per lane.
        RMS_NORM_X4_BF16 = "norm": "rms_norm_channels_x4_bf16";
        /// GroupNorm, middle launch: per-group statistics.
        GROUP_NORM_STATS = "norm": "group_norm_stats";
        /// Batched GEMM, all f32.
        GEMM_F32 = "gemm": "gemm_batched_f32";
        /// Batched GEMM, bf16 operands, f32 result.
        GEMM_BF16_BF16_F32 = "gemm": "gemm_batched_bf16_bf16_f32";
        /// Batched GEMM, f32 and bf16 operands, bf16 result.
        GEMM_F32_BF16_BF16 = "gemm": "gemm_batched_f32_bf16_bf16";
        /// Scaled row softmax in place.
        SOFTMAX_ROWS = "attention": "softmax_rows_f32";
        /// Scaled row softmax of f32 scores into bf16 probabilities.
        SOFTMAX_ROWS_TO_BF16 = "attention": "softmax_rows_to_bf16";
    }
}

#[cfg(test)]
mod tests {
    use super::ALL;
    use crate::cuda::embedded_modules;

    #[test]
    fn every_declared_kernel_is_an_entry_of_its_embedded_module() {
        let modules = embedded_modules();
        // A build without `cargo xtask kernels` embeds none (CI always builds them first).
        if modules.is_empty() {
            return;
        }
        for k in ALL {
            let module = modules.iter().find(|m| m.name == k.module);
            let module = module.unwrap_or_else(|| panic!("{}: no embedded module {:?}", k.name, k.module));
            for ptx in [module.ptx_compute_80, module.ptx_compute_90] {
                let entry = format!(".entry {}(", k.name);
                assert!(ptx.contains(&entry), "{} is not an entry point of {}.cu", k.name, k.module);
            }
        }
    }
}
