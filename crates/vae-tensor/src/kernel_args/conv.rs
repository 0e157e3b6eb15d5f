//! `kernels-cu/conv.cu` and `conv_sm90a.cu`: the channels-last copies of a convolution's input
//! and weights, and its product on the kernel the backend chose (the small-`Cout` CUDA-core
//! kernel, an `mma.sync` tile, a warpgroup-MMA tile).
//!
//! Every kernel here derives the padded channels-last extents `[N, Tp, Hp, Wp, Cp]` from the
//! geometry as [`ConvGeom::channels_last`] does, so the lengths checked below are the ones the
//! kernels index. The product kernels read 16 bytes at a time from `xp` and `wr`: both start
//! 16-byte aligned (whole allocations do, and the backend's views start at whole rows of whole
//! 16-byte chunks); a misaligned one faults the launch.

use cudarc::driver::LaunchConfig;

use super::{Instance, LaunchError, enqueue, holds, kernel_args, product, require, select, typed};
use crate::DType;
use crate::abi::{ChannelsLast, ConvGeom};
use crate::cuda::backend::{
    BF16_TILES, ConvKernel, CudaDevice, F32_TILES, SCORES_TILE, SMALL_COUT_SMEM, TF32_TILES, WGMMA_MODULE, WGMMA_TILES,
};
use crate::cuda::kernels::{self, Kernel};

pub(super) const CONV_INPUT: [Instance; 2] = typed(kernels::CONV_INPUT);
pub(super) const CONV_INPUT_SPLIT: [Instance; 2] = typed(kernels::CONV_INPUT_SPLIT);
pub(super) const CONV_WEIGHT: [Instance; 2] = typed(kernels::CONV_WEIGHT);

/// Operands and output of one storage type, or bf16 operands into f32 (attention's scores).
const F32_F32: &[(&str, DType)] = &[("T", DType::F32), ("TO", DType::F32)];
const BF16_BF16: &[(&str, DType)] = &[("T", DType::BF16), ("TO", DType::BF16)];
const BF16_F32: &[(&str, DType)] = &[("T", DType::BF16), ("TO", DType::F32)];

/// The threads of a block of every kernel here (`TC_THREADS`, and the copies' 256).
const THREADS: (u32, u32, u32) = (256, 1, 1);

kernel_args! {
    /// `conv_input_channels_last_*`: `x [N, Cin, T, H, W]` into the zero-padded channels-last
    /// `xp [N, Tp, Hp, Wp, Cp]`; grid `(N · Tp · Hp, ⌈Wp / 64⌉, ⌈Cp / 32⌉)`, a block per tile of
    /// 64 columns by 32 channels of one row.
    struct ConvInput<'a> {
        x: [const T*],
        xp: [T*],
        g: [ConvGeom],
    }

    /// `conv_input_channels_last_split_*`: as [`ConvInput`], the first `front_t` of the `g.t`
    /// frames read from `front [N, Cin, front_t, H, W]`, the others from `x`.
    struct ConvInputSplit<'a> {
        front: [const T*],
        front_t: [u64],
        x: [const T*],
        xp: [T*],
        g: [ConvGeom],
    }

    /// `conv_weight_channels_last_*`: `w [Cout, Cin, kt, kh, kw]` into `wr [Cout, kt, kh, kw,
    /// Cp]`, zero channels beyond `Cin`.
    struct ConvWeight<'a> {
        w: [const T*],
        wr: [T*],
        g: [ConvGeom],
    }

    /// The product of the channels-last operands (`conv3d_small_cout_*`, `conv3d_tc_*`,
    /// `conv3d_wgmma_*`): `out [N, Cout, To, Ho, Wo]` (+ `bias[co]`).
    struct ConvProduct<'a> {
        xp: [const T*],
        wr: [const T*],
        bias: [Option<const float*>],
        out: [TO*],
        g: [ConvGeom],
    }
}

/// `g`'s padded channels-last extents for elements of `dtype`, once its output extents are
/// known to be non-zero.
fn padded(kernel: Kernel, g: &ConvGeom, dtype: DType) -> Result<ChannelsLast, LaunchError> {
    require(kernel, g.to > 0 && g.ho > 0 && g.wo > 0, || format!("output extents {:?}", [g.to, g.ho, g.wo]))?;
    Ok(g.channels_last(dtype.size_in_bytes() as u64))
}

/// The checks both input copies share: blocks of 256 threads, exactly one block per padded row,
/// and enough of them across for every column and channel; `xp` holds the padded input.
fn check_input_copy(
    kernel: Kernel,
    g: &ConvGeom,
    dtype: DType,
    xp: usize,
    cfg: &LaunchConfig,
) -> Result<(), LaunchError> {
    let p = padded(kernel, g, dtype)?;
    let rows = product(&[g.n, p.t, p.h]);
    let (gx, gy, gz) = cfg.grid_dim;
    let fits = rows == Some(u64::from(gx)) && u64::from(gy) * 64 >= p.w && u64::from(gz) * 32 >= p.c;
    require(kernel, cfg.block_dim == THREADS && fits, || {
        format!("grid {:?} of {:?} for {rows:?} rows of {} x {}", cfg.grid_dim, cfg.block_dim, p.w, p.c)
    })?;
    holds(kernel, "xp", xp, product(&[g.n, p.t, p.h, p.w, p.c]))
}

impl ConvInput<'_> {
    /// Queues the copy on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &CONV_INPUT)?;
        let (k, g) = (instance.kernel, self.g);
        check_input_copy(k, &g, self.xp.dtype(), self.xp.len(), &cfg)?;
        holds(k, "x", self.x.len(), product(&[g.n, g.cin, g.t, g.h, g.w]))?;
        let f = device.function(k)?;
        // SAFETY: `instance` is the instantiation of the operands' storage type, `f` its entry
        // point, and `Self` declares its parameters (signature test, against conv.cu). Block `row`
        // (its sample `row / (Tp · Hp)` below `N`, as there are `N · Tp · Hp` blocks: checked)
        // reads `x` only where frame, row, column and channel fall inside `[N, Cin, T, H, W]`
        // (which `x` holds: checked) and writes `xp` only at columns below `Wp` and channels below
        // `Cp` of its row, inside the padded `[N, Tp, Hp, Wp, Cp]` `xp` holds (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl ConvInputSplit<'_> {
    /// Queues the copy on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &CONV_INPUT_SPLIT)?;
        let (k, g) = (instance.kernel, self.g);
        check_input_copy(k, &g, self.xp.dtype(), self.xp.len(), &cfg)?;
        require(k, self.front_t <= g.t, || format!("{} of {} frames in front", self.front_t, g.t))?;
        holds(k, "front", self.front.len(), product(&[g.n, g.cin, self.front_t, g.h, g.w]))?;
        holds(k, "x", self.x.len(), product(&[g.n, g.cin, g.t - self.front_t, g.h, g.w]))?;
        let f = device.function(k)?;
        // SAFETY: as `ConvInput::launch`; frame `t < g.t` of the input is read from `front`
        // (frame `t`, of `front_t`) where `t < front_t`, else from `x` (frame `t - front_t`, of
        // `g.t - front_t`), `front_t ≤ g.t` (checked), and each holds its frames (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl ConvWeight<'_> {
    /// Queues the copy on `device`.
    pub(crate) fn launch(self, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = select(&self, &CONV_WEIGHT)?;
        let (k, g) = (instance.kernel, self.g);
        let p = padded(k, &g, self.wr.dtype())?;
        let taps = product(&[g.kt, g.kh, g.kw]).unwrap_or(u64::MAX);
        holds(k, "wr", self.wr.len(), product(&[g.cout, taps, p.c]))?;
        holds(k, "w", self.w.len(), product(&[g.cout, g.cin, taps]))?;
        let f = device.function(k)?;
        // SAFETY: `instance` is the instantiation of the operands' storage type, `f` its entry
        // point, and `Self` declares its parameters (signature test). Grid-stride over `i <
        // Cout · taps · Cp` (whatever `cfg`), it writes `wr[i]` and reads `w[(co · Cin + c) ·
        // taps + tap]` for `c < Cin`: inside both (checked).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

impl ConvProduct<'_> {
    /// Queues the product on the kernel `kernel` on `device`: the small-`Cout` kernel's launch is
    /// grid-stride over the output pixels, a tile's covers its tiles with the dynamic shared
    /// memory they take.
    pub(crate) fn launch(self, kernel: ConvKernel, device: &CudaDevice, cfg: LaunchConfig) -> Result<(), LaunchError> {
        let instance = product_instance(kernel, self.xp.dtype())?;
        let (k, g) = (instance.kernel, self.g);
        super::check_types(&self, &instance)?;
        let elem = self.xp.dtype().size_in_bytes() as u64;
        let p = padded(k, &g, self.xp.dtype())?;
        let taps = product(&[g.kt, g.kh, g.kw]).unwrap_or(u64::MAX);
        let row = taps.checked_mul(p.c).filter(|r| r.checked_add(64).is_some_and(|r| r <= u64::from(u32::MAX)));
        require(k, row.is_some(), || format!("{taps} taps of {} channels exceed the kernels' 32-bit K range", p.c))?;
        require(k, cfg.block_dim == THREADS, || {
            format!("blocks of {:?}, the kernels take 256 threads", cfg.block_dim)
        })?;
        holds(k, "xp", self.xp.len(), product(&[g.n, p.t, p.h, p.w, p.c]))?;
        holds(k, "wr", self.wr.len(), product(&[g.cout, taps, p.c]))?;
        if let Some(bias) = &self.bias {
            holds(k, "bias", bias.len(), Some(g.cout))?;
        }
        holds(k, "out", self.out.len(), product(&[g.n, g.cout, g.to, g.ho, g.wo]))?;
        let cols = product(&[g.n, g.to, g.ho, g.wo]).unwrap_or(u64::MAX);
        let (gx, gy, _) = cfg.grid_dim;
        let f = match kernel {
            ConvKernel::SmallCout => {
                require(k, g.cout <= 4 && 4 * taps * p.c * elem <= SMALL_COUT_SMEM, || {
                    format!("{} output channels of {} weights each: not the small-Cout kernel's", g.cout, taps * p.c)
                })?;
                device.function(k)?
            }
            ConvKernel::TensorCores(tile) => {
                let (shared, (tx, ty, _)) = (tile.dynamic_shared_bytes(), tile.grid(cols, g.cout));
                require(k, cfg.shared_mem_bytes >= shared && gx >= tx && gy >= ty, || {
                    format!("grid {:?} with {} bytes of shared memory", cfg.grid_dim, cfg.shared_mem_bytes)
                })?;
                device.tensor_core_function(tile)?
            }
            ConvKernel::Wgmma(tile) => {
                let (shared, (tx, ty, _)) = (tile.dynamic_shared_bytes(), tile.grid(cols, g.cout));
                require(k, cfg.shared_mem_bytes >= shared && gx >= tx && gy >= ty, || {
                    format!("grid {:?} with {} bytes of shared memory", cfg.grid_dim, cfg.shared_mem_bytes)
                })?;
                device.wgmma_function(tile)?
            }
        };
        // SAFETY: `instance` is the entry point of `kernel` for the operands' storage types
        // (checked), `f` that entry point, and `Self` declares its parameters (signature test,
        // against conv.cu and conv_sm90a.cu). Every kernel reads `xp` only within the padded
        // input of an output pixel's receptive field (pixels below `N · To · Ho · Wo`, taps below
        // `kt · kh · kw`, channels below `Cp`), `wr` only at output channels below `Cout`, `bias`
        // there, and writes `out` at output channels below `Cout` and pixels below the count:
        // all inside the buffers (checked). Its 32-bit K counters hold `taps · Cp + 64` (checked).
        // The small-`Cout` kernel stages `4 · taps · Cp` weights in `SMALL_COUT_SMEM` bytes of
        // shared memory (checked); a tile gets its blocks of 256 threads and the dynamic shared
        // memory its stages take (checked, and the kernel traps on less).
        unsafe { enqueue(self, device, &f, cfg) }
    }
}

/// The instantiation `kernel` runs for operands of `dtype`.
fn product_instance(kernel: ConvKernel, dtype: DType) -> Result<Instance, LaunchError> {
    let conv = |name| Kernel { module: "conv", name };
    let (instance, known) = match kernel {
        ConvKernel::SmallCout => {
            let types = if dtype == DType::BF16 { BF16_BF16 } else { F32_F32 };
            (Instance { kernel: kernels::CONV_SMALL_COUT.of(dtype), types }, true)
        }
        ConvKernel::TensorCores(tile) => {
            let types = if tile == SCORES_TILE {
                BF16_F32
            } else if BF16_TILES.contains(&tile) {
                BF16_BF16
            } else {
                F32_F32
            };
            let known =
                tile == SCORES_TILE || BF16_TILES.iter().chain(&F32_TILES).chain(&TF32_TILES).any(|&t| t == tile);
            (Instance { kernel: conv(tile.name), types }, known)
        }
        ConvKernel::Wgmma(tile) => {
            let instance = Instance { kernel: Kernel { module: WGMMA_MODULE, name: tile.name }, types: BF16_BF16 };
            (instance, WGMMA_TILES.contains(&tile))
        }
    };
    require(instance.kernel, known, || "not a tile of the backend's tables".into())?;
    Ok(instance)
}

/// Every instantiation [`ConvProduct`] launches.
#[cfg(test)]
pub(super) fn products() -> Vec<Instance> {
    let mut all = typed(kernels::CONV_SMALL_COUT)
        .iter()
        .map(|i| Instance { types: if i.types == super::T_BF16 { BF16_BF16 } else { F32_F32 }, ..*i })
        .collect::<Vec<_>>();
    let tiles = BF16_TILES.iter().chain(&F32_TILES).chain(&TF32_TILES).chain([&SCORES_TILE]);
    all.extend(tiles.map(|&t| product_instance(ConvKernel::TensorCores(t), DType::F32).expect("a table's tile")));
    all.extend(
        WGMMA_TILES.iter().map(|&t| product_instance(ConvKernel::Wgmma(t), DType::BF16).expect("a table's tile")),
    );
    all
}
