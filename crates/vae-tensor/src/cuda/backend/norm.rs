//! The ops of `kernels-cu/norm.cu`: Wan's channel RMS norm and GroupNorm, each with an
//! optional fused SiLU.

use cudarc::driver::LaunchConfig;

use super::storage::{CudaStorage, per_pack};
use crate::backend::{DeviceNorm, DeviceStore};
use crate::kernel_args::{GroupNormApply, GroupNormPartials, GroupNormStats, RmsNorm, RmsNormX4};
use crate::{DType, Result, TensorError};

impl DeviceNorm for CudaStorage {
    /// Wan's channel RMS norm over `[batch, channels, inner]`, optionally followed by SiLU.
    fn rms_norm_channels(
        &self,
        gamma: &Self,
        bias: Option<&Self>,
        [batch, channels, inner]: [usize; 3],
        eps: f32,
        fuse_silu: bool,
    ) -> Result<Self> {
        Self::f32_param("rms_norm_channels", gamma)?;
        if let Some(b) = bias {
            Self::f32_param("rms_norm_channels", b)?;
        }
        let mut out = self.output(self.len)?;
        if self.len == 0 {
            return Ok(out);
        }
        // bf16 takes four pixels per lane (one 8-byte access) where the pixel count allows it.
        let four = self.dtype() == DType::BF16 && inner % 4 == 0;
        // Blocks of 32 pixel lanes by enough channel slices that each thread holds at most
        // RMS_HELD channels in registers (12 with one pixel per lane, 8 with four), as many slices
        // as the launch bound allows (768 or 512 threads; more channels are read twice, the
        // second time mostly from L2); one block per tile of 32 lanes up to several waves,
        // grid-stride beyond (see norm.cu).
        let (held, most, pixels) = if four { (8, 16, 4) } else { (12, 24, 1) };
        let slices = channels.div_ceil(held).clamp(1, most);
        let tiles = batch * inner.div_ceil(32 * pixels);
        let cfg = LaunchConfig {
            grid_dim: (tiles.clamp(1, self.device.sms * 16) as u32, 1, 1),
            block_dim: (32, slices as u32, 1),
            shared_mem_bytes: 0,
        };
        let (x, out_view) = (self.data.view(0), out.data.view_mut(0));
        let (gamma, bias) = (gamma.data.view(0), bias.map(|b| b.data.view(0)));
        let (batch, channels, inner, fuse_silu) = (batch as u64, channels as u64, inner as u64, i32::from(fuse_silu));
        let launched = if four {
            let norm = RmsNormX4 { x, out: out_view, gamma, bias, batch, channels, inner, eps, fuse_silu };
            norm.launch(&self.device, cfg)
        } else {
            let norm = RmsNorm { x, out: out_view, gamma, bias, batch, channels, inner, eps, fuse_silu };
            norm.launch(&self.device, cfg)
        };
        launched.map_err(self.err("rms_norm_channels"))?;
        Ok(out)
    }

    /// `nn.GroupNorm` over `[batch, channels, spatial]`, optionally followed by SiLU.
    fn group_norm(
        &self,
        gamma: &Self,
        beta: &Self,
        [batch, channels, spatial]: [usize; 3],
        groups: usize,
        eps: f32,
        fuse_silu: bool,
    ) -> Result<Self> {
        Self::f32_param("group_norm", gamma)?;
        Self::f32_param("group_norm", beta)?;
        let mut out = self.output(self.len)?;
        if self.len == 0 {
            return Ok(out);
        }
        // Three launches (see norm.cu): per-chunk sums and squared deviations, per-group
        // statistics, then every element. Chunks of at most 4096 elements (256 threads of 16
        // registers each); shorter ones, down to 1024 elements, where that puts about a thousand
        // blocks on the device.
        let group_len = channels / groups * spatial;
        let groups_total = batch * groups;
        let spread = 1024usize.div_ceil(groups_total).min(group_len.div_ceil(1024));
        let wanted = group_len.div_ceil(4096).max(spread).max(1);
        let chunk_len = group_len.div_ceil(wanted);
        let chunks = group_len.div_ceil(chunk_len);
        let rows = batch * channels;
        if groups_total > 65_535 {
            return Err(TensorError::InvalidArgument {
                op: "group_norm",
                reason: format!("{groups_total} (sample, group) pairs exceed one launch's 65535"),
            });
        }
        let mut partials = self.device.alloc_zeros::<f64>(2 * groups_total * chunks)?;
        let mut stats = self.device.alloc_zeros::<f64>(2 * groups_total)?;
        let per_chunk = LaunchConfig {
            grid_dim: (chunks as u32, groups_total as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (group_len, chunk_len) = (group_len as u64, chunk_len as u64);
        let sums = GroupNormPartials { x: self.data.view(0), partials: &mut partials, group_len, chunk_len };
        sums.launch(&self.device, per_chunk).map_err(self.err("group_norm"))?;
        let per_group = LaunchConfig {
            grid_dim: (groups_total.clamp(1, 65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (groups_total, chunks) = (groups_total as u64, chunks as u64);
        let statistics =
            GroupNormStats { partials: &partials, stats: &mut stats, groups_total, chunks, group_len, chunk_len, eps };
        statistics.launch(&self.device, per_group).map_err(self.err("group_norm"))?;
        // Rows of `spatial` elements (one per sample and channel) in grid y, pieces of a row in
        // grid x: enough blocks for a few waves over the whole tensor, each thread about one
        // 16-byte pack per row it visits.
        let grid_y = rows.clamp(1, 65_535);
        let per_row = spatial.div_ceil(per_pack(self.dtype()) * 256).max(1);
        let grid_x = per_row.min((self.device.sms * 32).div_ceil(grid_y)).max(1);
        let apply =
            LaunchConfig { grid_dim: (grid_x as u32, grid_y as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let normalise = GroupNormApply {
            x: self.data.view(0),
            out: out.data.view_mut(0),
            gamma: gamma.data.view(0),
            beta: beta.data.view(0),
            stats: &stats,
            rows: rows as u64,
            channels: channels as u64,
            spatial: spatial as u64,
            groups: groups as u64,
            fuse_silu: i32::from(fuse_silu),
        };
        normalise.launch(&self.device, apply).map_err(self.err("group_norm"))?;
        Ok(out)
    }
}
