//! CUDA tensor storage and the ops that run on it, through the embedded `kernels-cu/` modules.
//!
//! One [`CudaDevice`] per ordinal and process (context, default stream, the loaded modules),
//! created on first use. Work goes to the device's default stream, or to the calling thread's own
//! stream while it holds an [`OwnStream`] for the device (several ranks on one GPU, one stream
//! each; see `crate::StreamScope`). Storage is f32 or bf16 ([`CudaData`]); every op with a bf16 variant picks the
//! kernel by the storage type, computes in f32 and rounds once, as PyTorch's bf16 kernels do.
//! Per-channel parameters (biases, norm scales) stay f32 in both: a bf16 model keeps them as the
//! f32 values of its bf16 parameters. Every op checks its arguments on the host exactly as the
//! CPU op does (the CPU op's validation runs first; see the `Tensor` methods) and then launches
//! kernels on the device's stream; results come back to the host only when asked
//! (`to_device(Cpu)`, `to_vec_f32`; bf16 widens exactly to f32 on the way).
//!
//! Files by concern: [`device`] (registry and streams), [`storage`] (memory and the launchers'
//! shared checks), [`select`] (kernel choice and the thread's scopes), [`cudnn`] (cuDNN, loaded at
//! run time), [`conv_choice`] (our kernels or cuDNN's, per shape), and one file of ops per
//! `kernels-cu/` file, each launching its kernels through their typed launchers
//! (`crate::kernel_args`).

mod attention;
mod conv;
mod conv_choice;
mod conv_cudnn;
pub(crate) mod cudnn;
mod device;
mod elementwise;
mod gemm;
mod layout;
mod norm;
mod select;
mod storage;

pub use conv_choice::CHOICES_ENV;
pub(crate) use conv_choice::{
    Agreed as AgreedConvGuard, decision as conv_decision, export as export_conv_choices, import as import_conv_choices,
};
pub(crate) use device::{CudaDevice, OwnStream, driver};
pub(crate) use select::{
    BF16_TILES, ConvKernel, ConvTilesGuard, F32_TILES, SCORES_TILE, SMALL_COUT_SMEM, TF32_TILES, Tf32Guard,
    WGMMA_MODULE, WGMMA_TILES, wgmma_takes,
};
pub(crate) use storage::{CudaStorage, DataView, DataViewMut, Lender, stream_handle};
