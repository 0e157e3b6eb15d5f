//! `kernels-cu/norm.cu`: Wan's channel RMS norm and GroupNorm's three launches.

use cudarc::driver::LaunchConfig;

use super::{Instance, LaunchError, T_BF16, enqueue, holds, kernel_args, product, require, select, typed, whole_warps};
use crate::cuda::backend::CudaDevice;
use crate::cuda::kernels::{self, Kernel};

pub(super) const RMS_NORM: [Instance; 2] = typed(kernels::RMS_NORM);
pub(super) const RMS_NORM_X4: [Instance; 1] = [Instance { kernel: kernels::RMS_NORM_X4_BF16, types: T_BF16 }];
pub(super) const GROUP_NORM_PARTIALS: [Instance; 2] = typed(kernels::GROUP_NORM_PARTIALS);
pub(super) const GROUP_NORM_STATS: [Instance; 1] = [Instance { kernel: kernels::GROUP_NORM_STATS, types: &[] }];
pub(super) const GROUP_NORM_APPLY: [Instance; 2] = typed(kernels::GROUP_NORM_APPLY);

/// `RMS_THREADS(PIX)` of norm.cu: the launch bound of the RMS norms, and the per-thread slots
/// of their shared partial sums.
const RMS_THREADS: [u32; 2] = [768, 512];

kernel_args! {
    /// `rms_norm_channels_*`: each pixel of `[batch, channels, inner]` over its channels' RMS
    /// (`max(‖x‖₂, eps)`), times `√channels · gamma[c]` (+ `bias[c]`), SiLU when `fuse_silu`.
    struct RmsNorm<'a> {
        x: [const T*],
        out: [T*],
        gamma: [const float*],
        bias: [Option<const float*>],
        batch: [u64],
        channels: [u64],
        inner: [u64],
        eps: [float],
        fuse_silu: [int],
    }

    /// `rms_norm_channels_x4_bf16`: [`RmsNorm`] on bf16, four pixels per lane in one 8-byte
    /// access (`inner` a multiple of 4).
    struct RmsNormX4<'a> {
        x: [const T*],
        out: [T*],
        gamma: [const float*],
        bias: [Option<const float*>],
        batch: [u64],
        channels: [u64],
        inner: [u64],
        eps: [float],
        fuse_silu: [int],
    }

    /// `group_norm_partials_*`: block `(chunk, group)` of grid `(chunks, groups)` writes the sum
    /// and the squared deviations of elements `chunk · chunk_len..` (at most `chunk_len`) of
    /// group `group` (`group_len` elements from `group · group_len`) to `partials[2 · (group ·
    /// chunks + chunk)..+2]`.
    struct GroupNormPartials<'a> {
        x: [const T*],
        partials: [double*],
        group_len: [u64],
        chunk_len: [u64],
    }

    /// `group_norm_stats`: each group's mean and `1 / √(var + eps)` into `stats[2 · group..+2]`
    /// from its `chunks` partials.
    struct GroupNormStats<'a> {
        partials: [const double*],
        stats: [double*],
        groups_total: [u64],
        chunks: [u64],
        group_len: [u64],
        chunk_len: [u64],
        eps: [float],
    }

    /// `group_norm_apply_*`: `rows` rows of `spatial` elements (row `r` is channel `r %
    /// channels` of sample `r / channels`) normalised by their group's statistics, times
    /// `gamma[c]`, plus `beta[c]`, SiLU when `fuse_silu`.
    struct GroupNormApply<'a> {
        x: [const T*],
        out: [T*],
        gamma: [const float*],
        beta: [const float*],
        stats: [const double*],
        rows: [u64],
        channels: [u64],
        spatial: [u64],
        groups: [u64],
        fuse_silu: [int],
    }
}

/// The checks both RMS norms share: `[batch, channels, inner]` in `x` and `out`, a parameter
/// per channel, at most `threads` threads per block.
#[allow(clippy::too_many_arguments)] // the kernel's buffers and extents
fn rms_checks(
    kernel: Kernel,
    [x, out, gamma]: [usize; 3],
    bias: Option<usize>,
    [batch, channels, inner]: [u64; 3],
    cfg: &LaunchConfig,
    threads: u32,
) -> Result<(), LaunchError> {
    let elems = product(&[batch, channels, inner]);
    holds(kernel, "x", x, elems)?;
    holds(kernel, "out", out, elems)?;
    holds(kernel, "gamma", gamma, Some(channels))?;
    if let Some(bias) = bias {
        holds(kernel, "bias", bias, Some(channels))?;
    }
    let (bx, by, bz) = cfg.block_dim;
    let given = u64::from(bx) * u64::from(by) * u64::from(bz);
    require(kernel, given <= u64::from(threads), || format!("{given} threads per block, at most {threads}"))
}

impl RmsNorm<'_> {
    /// Queues the norm on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &RMS_NORM)?;
        let lens = [self.x.len(), self.out.len(), self.gamma.len()];
        let dims = [self.batch, self.channels, self.inner];
        rms_checks(instance.kernel, lens, self.bias.as_ref().map(|b| b.len()), dims, &cfg, RMS_THREADS[0])?;
        let f = device.function(instance.kernel)?;
        // SAFETY: `instance` is the instantiation of the operands' storage type, `f` its entry
        // point, and `Self` declares its parameters (signature test, against norm.cu). The kernel
        // visits samples `b < batch`, pixels `s < inner` and channels `c < channels` only (tiles
        // grid-stride, channels strided by the block's slices), reading `x` and writing `out`
        // at `(b · channels + c) · inner + s`, `gamma[c]` and `bias[c]`: all inside the buffers
        // (checked). Its shared partial sums have a slot per thread of a block of at most
        // `RMS_THREADS(1)` threads (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl RmsNormX4<'_> {
    /// Queues the norm on `device`. `x` and `out` start 8-byte aligned (whole allocations do);
    /// a misaligned one faults the launch.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &RMS_NORM_X4)?;
        let lens = [self.x.len(), self.out.len(), self.gamma.len()];
        let dims = [self.batch, self.channels, self.inner];
        rms_checks(instance.kernel, lens, self.bias.as_ref().map(|b| b.len()), dims, &cfg, RMS_THREADS[1])?;
        require(instance.kernel, self.inner.is_multiple_of(4), || {
            format!("{} pixels per channel, not whole fours", self.inner)
        })?;
        let f = device.function(instance.kernel)?;
        // SAFETY: as `RmsNorm::launch`, four pixels `s..s + 4` per lane with `s` a multiple of 4:
        // with `inner` one too (checked), a lane's pixels are all below `inner` or none is, so
        // every access stays in its row of `inner`; the block's threads are at most
        // `RMS_THREADS(4)` (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl GroupNormPartials<'_> {
    /// Queues the partial sums on `device`: `cfg`'s grid is `(chunks, groups)`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &GROUP_NORM_PARTIALS)?;
        let k = instance.kernel;
        whole_warps(k, &cfg, 256)?;
        let (chunks, groups, _) = cfg.grid_dim;
        let (chunks, groups) = (u64::from(chunks), u64::from(groups));
        let last_start = chunks.saturating_sub(1).checked_mul(self.chunk_len);
        require(k, self.chunk_len > 0 && last_start.is_some_and(|s| s < self.group_len), || {
            format!(
                "{chunks} chunks of {} elements do not each start inside a group of {}",
                self.chunk_len, self.group_len
            )
        })?;
        holds(k, "x", self.x.len(), product(&[groups, self.group_len]))?;
        holds(k, "partials", self.partials.len(), product(&[2, chunks, groups]))?;
        let f = device.function(k)?;
        // SAFETY: `instance` is the instantiation of `x`'s storage type, `f` its entry point, and
        // `Self` declares its parameters (signature test). Block `(chunk, group)` reads elements
        // `start..min(start + chunk_len, group_len)` of group `group < groups`, from `group ·
        // group_len + start`, where `start = chunk · chunk_len < group_len` (checked: the range
        // is never empty, and never wraps), so inside `x`'s `groups · group_len` (checked); it
        // writes `partials[2 · (group · chunks + chunk)..+2]`, inside its `2 · chunks · groups`
        // (checked). The block sums need whole warps, at most 32 of them (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl GroupNormStats<'_> {
    /// Queues the per-group statistics on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &GROUP_NORM_STATS)?;
        let k = instance.kernel;
        whole_warps(k, &cfg, 1024)?;
        holds(k, "partials", self.partials.len(), product(&[2, self.groups_total, self.chunks]))?;
        holds(k, "stats", self.stats.len(), product(&[2, self.groups_total]))?;
        let f = device.function(k)?;
        // SAFETY: `f` is `group_norm_stats`, whose parameters `Self` declares (signature test).
        // Grid-stride over groups `g < groups_total`, it reads `partials[2 · (g · chunks + c)..+2]`
        // for `c < chunks` and writes `stats[2 · g..+2]`: inside both (checked). The block sums
        // need whole warps, at most 32 of them (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl GroupNormApply<'_> {
    /// Queues the normalisation on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &GROUP_NORM_APPLY)?;
        let k = instance.kernel;
        let (rows, channels, groups) = (self.rows, self.channels, self.groups);
        require(k, rows == 0 || (groups > 0 && channels > 0 && channels % groups == 0), || {
            format!("{channels} channels in {groups} groups")
        })?;
        let elems = product(&[rows, self.spatial]);
        holds(k, "x", self.x.len(), elems)?;
        holds(k, "out", self.out.len(), elems)?;
        if rows > 0 {
            holds(k, "gamma", self.gamma.len(), Some(channels))?;
            holds(k, "beta", self.beta.len(), Some(channels))?;
            holds(k, "stats", self.stats.len(), product(&[2, rows.div_ceil(channels), groups]))?;
        }
        let f = device.function(k)?;
        // SAFETY: `instance` is the instantiation of the operands' storage type, `f` its entry
        // point, and `Self` declares its parameters (signature test). Rows `r < rows` grid-stride
        // in y and elements `i < spatial` of a row in x (16-byte packs only where both buffers and
        // rows are aligned), it reads `x` and writes `out` at `r · spatial + i`, inside both
        // (checked); `gamma[c]`, `beta[c]` for `c = r % channels`; and the statistics of group
        // `(r / channels) · groups + c / (channels / groups)`, below `ceil(rows / channels) ·
        // groups` since `groups` divides `channels` (checked), two each.
        unsafe { enqueue(self, device, &f, cfg) }
    }
}
