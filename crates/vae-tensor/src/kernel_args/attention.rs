//! `kernels-cu/attention.cu`: the scaled row softmax of attention's scores.

use cudarc::driver::LaunchConfig;

use super::{Instance, LaunchError, enqueue, holds, kernel_args, product, select, whole_warps};
use crate::cuda::backend::CudaDevice;
use crate::cuda::kernels;

pub(super) const SOFTMAX_ROWS: [Instance; 1] = [Instance { kernel: kernels::SOFTMAX_ROWS, types: &[] }];
pub(super) const SOFTMAX_ROWS_TO_BF16: [Instance; 1] = [Instance { kernel: kernels::SOFTMAX_ROWS_TO_BF16, types: &[] }];

kernel_args! {
    /// `softmax_rows_f32`: `softmax(x[r] · scale)` of each of `rows` rows of `cols`, in place.
    struct SoftmaxRows<'a> {
        x: [float*],
        rows: [u64],
        cols: [u64],
        scale: [float],
    }

    /// `softmax_rows_to_bf16`: the same into bf16 probabilities `p` (`x` is left holding the
    /// exponentials).
    struct SoftmaxRowsToBf16<'a> {
        x: [float*],
        p: [unsigned short*],
        rows: [u64],
        cols: [u64],
        scale: [float],
    }
}

impl SoftmaxRows<'_> {
    /// Queues the softmax on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &SOFTMAX_ROWS)?;
        let k = instance.kernel;
        whole_warps(k, &cfg, 1024)?;
        holds(k, "x", self.x.len(), product(&[self.rows, self.cols]))?;
        let f = device.function(k)?;
        // SAFETY: `f` is `softmax_rows_f32`, whose parameters `Self` declares (signature test,
        // against attention.cu), and `x` is f32 (checked). Grid-stride over rows `r < rows`, a
        // block's threads stride over `j < cols`, touching `x[r · cols + j]` only: inside `x`
        // (checked). The block reductions need whole warps, at most 32 of them (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl SoftmaxRowsToBf16<'_> {
    /// Queues the softmax on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &SOFTMAX_ROWS_TO_BF16)?;
        let k = instance.kernel;
        whole_warps(k, &cfg, 1024)?;
        let elems = product(&[self.rows, self.cols]);
        holds(k, "x", self.x.len(), elems)?;
        holds(k, "p", self.p.len(), elems)?;
        let f = device.function(k)?;
        // SAFETY: as `SoftmaxRows::launch`, with `p` bf16 (checked) and written at the same
        // `r · cols + j`: inside it (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}
