//! Which kernel runs a convolution: the tensor-core tile shapes, the warpgroup-MMA tiles, the
//! small-`Cout` CUDA-core kernel, and the calling thread's choices that steer them (TF32 mode,
//! the tile widths a caller allows, the warpgroup-MMA switch).

use std::sync::OnceLock;

use super::super::{CONV_ENV, ConvKernels, WGMMA_ENV};
use crate::DType;

/// `SMALL_COUT_SMEM` of conv.cu: the bytes of weights (4 output channels' worth) the small-Cout
/// convolution stages in shared memory.
pub(crate) const SMALL_COUT_SMEM: u64 = 45056;

/// How the tensor-core conv multiplies: bf16 products, f32 products as three TF32 products (f32
/// accuracy), or one TF32 product each (TF32 mode, see [`Tf32Guard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TensorCoreMath {
    Bf16,
    F32,
    Tf32,
}

impl TensorCoreMath {
    /// The storage type of the operands.
    pub(super) fn dtype(self) -> DType {
        match self {
            Self::Bf16 => DType::BF16,
            Self::F32 | Self::Tf32 => DType::F32,
        }
    }

    /// A convolution's products for operands of `dtype` on the calling thread.
    pub(super) fn for_conv(dtype: DType) -> Self {
        match dtype {
            DType::BF16 => Self::Bf16,
            _ if TF32_CONVOLUTIONS.get() => Self::Tf32,
            _ => Self::F32,
        }
    }
}

thread_local! {
    /// Whether this thread's f32 convolutions take one TF32 product per product.
    static TF32_CONVOLUTIONS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// TF32 mode for the calling thread's f32 convolutions while this lives (see `crate::Tf32Scope`).
pub(crate) struct Tf32Guard {
    previous: bool,
}

impl Tf32Guard {
    pub(crate) fn enter() -> Self {
        Self { previous: TF32_CONVOLUTIONS.replace(true) }
    }
}

impl Drop for Tf32Guard {
    fn drop(&mut self) {
        TF32_CONVOLUTIONS.set(self.previous);
    }
}

thread_local! {
    /// The kernels this thread's tensor-core convolutions must take (see [`ConvTilesGuard`]).
    static CONV_KERNELS: std::cell::Cell<Option<ConvKernels>> = const { std::cell::Cell::new(None) };
}

/// Restricts the calling thread's tensor-core convolutions to `kernels` while this lives
/// (`crate::cuda::ConvTilesScope`).
pub(crate) struct ConvTilesGuard {
    previous: Option<ConvKernels>,
}

impl ConvTilesGuard {
    pub(crate) fn enter(kernels: Option<ConvKernels>) -> Self {
        Self { previous: CONV_KERNELS.replace(kernels) }
    }
}

impl Drop for ConvTilesGuard {
    fn drop(&mut self) {
        CONV_KERNELS.set(self.previous);
    }
}

/// Where a convolution runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ConvRoute {
    /// Our kernels.
    Ours,
    /// cuDNN's first admissible algorithm ([`ConvKernels::Cudnn`]).
    Cudnn,
    /// The per-shape choice ([`ConvKernels::Fastest`]).
    Fastest,
}

/// Where the calling thread's convolutions run: as its group's rank 0 decided where the
/// thread follows such a decision (`conv_choice::Agreed`), else as a [`ConvTilesGuard`] says,
/// else as [`CONV_ENV`] says (read once per process), else on our kernels.
pub(super) fn conv_route() -> ConvRoute {
    static DEFAULT: OnceLock<Option<ConvKernels>> = OnceLock::new();
    if let Some(route) = super::conv_choice::agreed_route() {
        return route;
    }
    let kernels =
        CONV_KERNELS.get().or_else(|| *DEFAULT.get_or_init(|| conv_env_says(std::env::var(CONV_ENV).ok().as_deref())));
    match kernels {
        Some(ConvKernels::Cudnn) => ConvRoute::Cudnn,
        Some(ConvKernels::Fastest) => ConvRoute::Fastest,
        _ => ConvRoute::Ours,
    }
}

/// What a value of [`CONV_ENV`] asks for: `cudnn` or `fastest`; unset, empty and `auto` leave the
/// backend's own kernels; anything else leaves them with a warning.
pub(super) fn conv_env_says(value: Option<&str>) -> Option<ConvKernels> {
    match value.map(str::trim) {
        None | Some("" | "auto") => None,
        Some(v) => match v.parse::<ConvKernels>() {
            Ok(k @ (ConvKernels::Cudnn | ConvKernels::Fastest)) => Some(k),
            _ => {
                tracing::warn!("{CONV_ENV}={v:?} is not auto, cudnn or fastest: our kernels run");
                None
            }
        },
    }
}

/// The module of the warpgroup-MMA convolutions (`kernels-cu/conv_sm90a.cu`).
pub(crate) const WGMMA_MODULE: &str = "conv_sm90a";

/// Whether this thread's bf16 convolutions take the warpgroup-MMA kernels where a device has them:
/// as a [`ConvTilesGuard`] says, else as [`WGMMA_ENV`] says (read once per process).
pub(super) fn wgmma_wanted() -> bool {
    static DEFAULT: OnceLock<bool> = OnceLock::new();
    match CONV_KERNELS.get() {
        Some(kernels) => kernels == ConvKernels::Wgmma,
        None => *DEFAULT.get_or_init(|| wgmma_env_says(std::env::var(WGMMA_ENV).ok().as_deref())),
    }
}

/// What a value of [`WGMMA_ENV`] asks for: `1`, `true`, `yes` or `on` (any case) turn the
/// warpgroup-MMA kernels on; unset, empty, `0`, `false`, `no` and `off` leave them off; anything
/// else leaves them off with a warning, rather than being read as either.
pub(super) fn wgmma_env_says(value: Option<&str>) -> bool {
    let Some(value) = value.map(str::trim) else { return false };
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => true,
        "" | "0" | "false" | "no" | "off" => false,
        _ => {
            tracing::warn!("{WGMMA_ENV}={value:?} is not 1/true/yes/on or 0/false/no/off: the wgmma kernels stay off");
            false
        }
    }
}

/// Whether the warpgroup-MMA kernels take convolutions of `dtype`: bf16 only (TF32 `wgmma` reads
/// f32 operands unrounded, and the 3xTF32 split needs register operands).
pub(crate) fn wgmma_takes(dtype: DType) -> bool {
    dtype == DType::BF16
}

/// A warpgroup-MMA convolution kernel (conv_sm90a.cu's `conv3d_wgmma_bf16_n<N>`): tiles of 128
/// output pixels by `channels` output channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WgmmaTile {
    pub(crate) channels: u64,
    pub(crate) name: &'static str,
}

impl WgmmaTile {
    /// conv_sm90a.cu's `WGMMA_SMEM(N)`: its stages (5 of 192 and 256 channels, 6 of fewer) of
    /// `channels + 128` rows of 64 bytes, and 512 bytes to align them.
    pub(crate) fn dynamic_shared_bytes(&self) -> u32 {
        let stages = if self.channels >= 192 { 5 } else { 6 };
        (stages * (self.channels + 128) * 64 + 512) as u32
    }

    pub(crate) fn grid(&self, cols: u64, cout: u64) -> (u32, u32, u32) {
        (cols.div_ceil(128) as u32, cout.div_ceil(self.channels) as u32, 1)
    }
}

/// The warpgroup-MMA kernel for `cout` output channels: the tile width (96, 128, 192 or 256
/// channels) that pads `cout` least, the widest of those. It depends on `cout` alone, never on the
/// grid, so that every rank of a sharded or tiled decode runs a given convolution on the same
/// kernel as one device would.
pub(super) fn wgmma_tile(cout: u64) -> WgmmaTile {
    *WGMMA_TILES.iter().min_by_key(|t| cout.div_ceil(t.channels) * t.channels).expect("tiles")
}

/// The warpgroup-MMA tiles, widest first.
pub(crate) const WGMMA_TILES: [WgmmaTile; 4] = [
    WgmmaTile { channels: 256, name: "conv3d_wgmma_bf16_n256" },
    WgmmaTile { channels: 192, name: "conv3d_wgmma_bf16_n192" },
    WgmmaTile { channels: 128, name: "conv3d_wgmma_bf16_n128" },
    WgmmaTile { channels: 96, name: "conv3d_wgmma_bf16_n96" },
];

/// A tensor-core convolution kernel (conv.cu's `conv3d_tc_*`): tiles of `rows` output channels
/// by `pixels` output pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TensorCoreTile {
    pub(crate) rows: u64,
    pub(crate) pixels: u64,
    pub(crate) name: &'static str,
}

impl TensorCoreTile {
    pub(super) const fn new(rows: u64, pixels: u64, name: &'static str) -> Self {
        Self { rows, pixels, name }
    }

    /// The dynamic shared memory its launch gives: conv.cu's `TC_WIDE_SMEM(MT)` for tiles of 256
    /// pixels (four stages of `rows + 256` rows of 64 bytes); tiles of 128 pixels use static
    /// shared memory.
    pub(crate) fn dynamic_shared_bytes(&self) -> u32 {
        if self.pixels == 256 { (4 * (self.rows + 256) * 64) as u32 } else { 0 }
    }

    /// The launch grid over `cols` output pixels and `cout` output channels.
    pub(crate) fn grid(&self, cols: u64, cout: u64) -> (u32, u32, u32) {
        (cols.div_ceil(self.pixels) as u32, cout.div_ceil(self.rows) as u32, 1)
    }
}

/// How much faster a tile of 256 pixels multiplies than two of 128 (one block per
/// multiprocessor against two): half the operand bytes per product from L2 and from shared
/// memory. An estimate, as a ratio 5/4, until `bench kernels` (which times both shapes side by
/// side on the GPU) measures it; both shapes give bit-identical results.
pub(super) const WIDE_TILE_SPEEDUP: (u64, u64) = (5, 4);

/// The tensor-core conv's kernel for `cout` output channels and `cols` output pixels on `sms`
/// multiprocessors. Heights are 128 (not with 3xTF32: its operand split leaves no registers
/// for it), 96 and 64 output channels; widths 128 pixels (two blocks per multiprocessor) and
/// 256 (one, [`WIDE_TILE_SPEEDUP`] faster per product). The choice is the one whose busiest
/// multiprocessor has the least to do, `ceil(blocks / sms) * (rows + 32) * pixels / speed`. A
/// block's cost is its rows plus a fixed part for the pixel tile every block loads whatever its
/// height (worth about 32 rows: it is why taller tiles multiply more per byte loaded). That
/// leaves no idle rows where a height divides `cout` (Wan's 96 and 192 channels take 96) and,
/// on small grids (a 60x104 frame at 384 channels is 49 tiles of 128 pixels), prefers more,
/// smaller tiles to a second, nearly empty wave. Ties go to the taller, then the wider tile. A
/// [`ConvTilesGuard`] on the calling thread restricts the widths.
pub(super) fn tensor_core_tile(math: TensorCoreMath, cout: u64, cols: u64, sms: u64) -> TensorCoreTile {
    let tiles: &[TensorCoreTile] = match math {
        TensorCoreMath::Bf16 => &BF16_TILES,
        TensorCoreMath::F32 => &F32_TILES,
        TensorCoreMath::Tf32 => &TF32_TILES,
    };
    let only = CONV_KERNELS.get().and_then(ConvKernels::mma_pixels);
    let (fast, slow) = WIDE_TILE_SPEEDUP;
    tiles
        .iter()
        .copied()
        .filter(|t| only.is_none_or(|p| p == t.pixels))
        .min_by_key(|t| {
            let blocks = cols.div_ceil(t.pixels) * cout.div_ceil(t.rows);
            let speed = if t.pixels == 256 { fast } else { slow };
            let cost = blocks.div_ceil(sms) * (t.rows + 32) * t.pixels * (fast * slow / speed);
            (cost, u64::MAX - t.rows, u64::MAX - t.pixels)
        })
        .expect("tile shapes")
}

/// The `mma.sync` tiles of bf16 products.
pub(crate) const BF16_TILES: [TensorCoreTile; 6] = [
    TensorCoreTile::new(128, 128, "conv3d_tc_bf16_m4"),
    TensorCoreTile::new(96, 128, "conv3d_tc_bf16_m3"),
    TensorCoreTile::new(64, 128, "conv3d_tc_bf16_m2"),
    TensorCoreTile::new(128, 256, "conv3d_tc_bf16_m4_n256"),
    TensorCoreTile::new(96, 256, "conv3d_tc_bf16_m3_n256"),
    TensorCoreTile::new(64, 256, "conv3d_tc_bf16_m2_n256"),
];

/// The `mma.sync` tiles of f32 products as three TF32 products (no 128-row tile: its operand
/// split leaves no registers for it).
pub(crate) const F32_TILES: [TensorCoreTile; 4] = [
    TensorCoreTile::new(96, 128, "conv3d_tc_f32_m3"),
    TensorCoreTile::new(64, 128, "conv3d_tc_f32_m2"),
    TensorCoreTile::new(96, 256, "conv3d_tc_f32_m3_n256"),
    TensorCoreTile::new(64, 256, "conv3d_tc_f32_m2_n256"),
];

/// The `mma.sync` tiles of f32 products as one TF32 product (TF32 mode).
pub(crate) const TF32_TILES: [TensorCoreTile; 6] = [
    TensorCoreTile::new(128, 128, "conv3d_tc_tf32_m4"),
    TensorCoreTile::new(96, 128, "conv3d_tc_tf32_m3"),
    TensorCoreTile::new(64, 128, "conv3d_tc_tf32_m2"),
    TensorCoreTile::new(128, 256, "conv3d_tc_tf32_m4_n256"),
    TensorCoreTile::new(96, 256, "conv3d_tc_tf32_m3_n256"),
    TensorCoreTile::new(64, 256, "conv3d_tc_tf32_m2_n256"),
];

/// Attention's scores: bf16 operands, an f32 product.
pub(crate) const SCORES_TILE: TensorCoreTile = TensorCoreTile::new(128, 128, "conv3d_tc_bf16_f32out_m4");

/// The kernel of a convolution's product (after the channels-last copies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConvKernel {
    /// The tensor-core implicit GEMM on `mma.sync`.
    TensorCores(TensorCoreTile),
    /// The same on Hopper's warpgroup MMA (bf16).
    Wgmma(WgmmaTile),
    /// At most 4 output channels on CUDA cores (`conv3d_small_cout_*_c4`).
    SmallCout,
}

/// The kernel for `cout` output channels whose weights are `taps * cp` elements of `elem_bytes`
/// each per channel, over `cols` output pixels, on a device of `sms` multiprocessors that has the
/// warpgroup-MMA kernels or not (`wgmma`): at most 4 output channels (the RGB heads) on CUDA
/// cores when 4 channels' weights fit the kernel's shared memory (a tensor-core tile would
/// multiply 60 and more rows of zeros); bf16 with at least 96 output channels on the
/// warpgroup-MMA tile of [`wgmma_tile`] where the device has it and the thread wants it
/// ([`wgmma_wanted`]); else the `mma.sync` tile of [`tensor_core_tile`].
pub(super) fn conv_kernel(
    math: TensorCoreMath,
    cout: u64,
    weights_per_channel: u64,
    elem_bytes: u64,
    cols: u64,
    sms: u64,
    wgmma: bool,
) -> ConvKernel {
    if cout <= 4 && 4 * weights_per_channel * elem_bytes <= SMALL_COUT_SMEM {
        return ConvKernel::SmallCout;
    }
    if wgmma && wgmma_takes(math.dtype()) && cout >= 96 && wgmma_wanted() {
        return ConvKernel::Wgmma(wgmma_tile(cout));
    }
    ConvKernel::TensorCores(tensor_core_tile(math, cout, cols, sms))
}

#[cfg(test)]
mod tests {
    use super::{
        ConvKernel, ConvKernels, ConvRoute, ConvTilesGuard, SMALL_COUT_SMEM, TensorCoreMath, conv_env_says,
        conv_kernel, conv_route, tensor_core_tile, wgmma_env_says, wgmma_tile,
    };

    /// A large Wan2.1 chunk (4 frames of 480x832) and an H200's multiprocessors.
    const BIG: u64 = 4 * 480 * 832;
    const SMS: u64 = 132;

    #[test]
    fn tensor_core_tiles_leave_no_idle_rows_and_fill_small_grids() {
        for math in [TensorCoreMath::Bf16, TensorCoreMath::F32, TensorCoreMath::Tf32] {
            assert_eq!(tensor_core_tile(math, 96, BIG, SMS).rows, 96);
            assert_eq!(tensor_core_tile(math, 192, BIG, SMS).rows, 96);
            // Fewer output channels than any tile: the shortest (the RGB heads whose weights do
            // not fit the small-Cout kernel; see the test below).
            assert_eq!(tensor_core_tile(math, 3, BIG, SMS).rows, 64);
            // Large grids take the wide tiles (a few partial waves cost little there).
            assert_eq!(tensor_core_tile(math, 96, BIG, SMS).pixels, 256);
        }
        // 384 channels of one 60x104 frame (6240 pixels): 25 x 3 wide tiles of 128 rows would
        // leave 57 multiprocessors idle, 49 x 3 narrow ones two blocks on 15 of them; 25 x 4
        // wide tiles of 96 rows give 100 multiprocessors one each.
        let small = tensor_core_tile(TensorCoreMath::Bf16, 384, 60 * 104, SMS);
        assert_eq!((small.rows, small.pixels), (96, 256));
        let wide = tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS);
        assert_eq!((wide.rows, wide.pixels, wide.name), (128, 256, "conv3d_tc_bf16_m4_n256"));
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 768, BIG, SMS).rows, 128);
        assert_eq!(tensor_core_tile(TensorCoreMath::F32, 384, BIG, SMS).name, "conv3d_tc_f32_m3_n256");
        assert_eq!(tensor_core_tile(TensorCoreMath::Tf32, 384, BIG, SMS).name, "conv3d_tc_tf32_m4_n256");
        // Tiny grids (one tile of pixels): the narrow tiles, more of them.
        let tiny = tensor_core_tile(TensorCoreMath::Bf16, 384, 100, SMS);
        assert_eq!((tiny.rows, tiny.pixels), (64, 128));
    }

    #[test]
    fn a_guard_restricts_the_tile_width_on_its_thread_only() {
        let narrow = {
            let _only = ConvTilesGuard::enter(Some(ConvKernels::Pixels128));
            let t = tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS);
            let other = std::thread::spawn(|| tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS)).join();
            assert_eq!(other.expect("thread").pixels, 256);
            t
        };
        assert_eq!((narrow.rows, narrow.pixels, narrow.name), (128, 128, "conv3d_tc_bf16_m4"));
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS).pixels, 256);
        let _only = ConvTilesGuard::enter(Some(ConvKernels::Pixels256));
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 384, 100, SMS).pixels, 256);
    }

    #[test]
    fn wide_tiles_ask_for_their_four_stages_of_dynamic_shared_memory() {
        let _only = ConvTilesGuard::enter(Some(ConvKernels::Pixels256));
        // conv.cu's TC_WIDE_SMEM(MT) = 4 * (32 * MT + 256) * 64; narrow tiles use static memory.
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS).dynamic_shared_bytes(), 98_304);
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 96, BIG, SMS).dynamic_shared_bytes(), 90_112);
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 3, BIG, SMS).dynamic_shared_bytes(), 81_920);
        drop(_only);
        let _only = ConvTilesGuard::enter(Some(ConvKernels::Pixels128));
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS).dynamic_shared_bytes(), 0);
    }

    #[test]
    fn rgb_heads_run_on_cuda_cores_when_their_weights_fit() {
        // Wan's head: 96 channels, 27 taps, in bf16 and in f32 (41.5 KiB of 44).
        assert_eq!(conv_kernel(TensorCoreMath::Bf16, 3, 27 * 96, 2, BIG, SMS, true), ConvKernel::SmallCout);
        assert_eq!(conv_kernel(TensorCoreMath::F32, 3, 27 * 96, 4, BIG, SMS, false), ConvKernel::SmallCout);
        assert_eq!(conv_kernel(TensorCoreMath::Bf16, 4, 9 * 128, 2, BIG, SMS, false), ConvKernel::SmallCout);
        // Too many weights for the kernel's shared memory, or more than 4 channels: tensor cores.
        let over = SMALL_COUT_SMEM / (4 * 4) + 4;
        assert!(matches!(
            conv_kernel(TensorCoreMath::F32, 3, over, 4, BIG, SMS, false),
            ConvKernel::TensorCores(t) if t.rows == 64
        ));
        assert!(matches!(
            conv_kernel(TensorCoreMath::Bf16, 5, 27 * 96, 2, BIG, SMS, false),
            ConvKernel::TensorCores(_)
        ));
    }

    #[test]
    fn wgmma_tiles_pad_the_channels_least_and_ignore_the_grid() {
        let channels = |cout| wgmma_tile(cout).channels;
        // Wan's 96 and 192, AutoencoderKL's 128, 256 and 512: no idle channels.
        assert_eq!([channels(96), channels(128), channels(192), channels(256)], [96, 128, 192, 256]);
        // Ties go to the widest: 384 = 2 x 192 (not 3 x 128 or 4 x 96), 768 = 3 x 256.
        assert_eq!([channels(384), channels(512), channels(768)], [192, 256, 256]);
        // 200 channels: 256 pads 56, 128 x 2 pads as much, 96 x 3 more.
        assert_eq!(channels(200), 256);
        assert_eq!(wgmma_tile(96).name, "conv3d_wgmma_bf16_n96");
        // conv_sm90a.cu's WGMMA_SMEM(N): 6 stages below 192 channels, 5 from there, + 512.
        assert_eq!(wgmma_tile(96).dynamic_shared_bytes(), 6 * 224 * 64 + 512);
        assert_eq!(wgmma_tile(256).dynamic_shared_bytes(), 5 * 384 * 64 + 512);
    }

    #[test]
    fn wgmma_takes_bf16_convolutions_of_96_channels_and_more_where_the_device_has_it() {
        let _wgmma = ConvTilesGuard::enter(Some(ConvKernels::Wgmma));
        let kernel = |math, cout, wgmma| conv_kernel(math, cout, 27 * 96, 2, BIG, SMS, wgmma);
        assert!(matches!(kernel(TensorCoreMath::Bf16, 96, true), ConvKernel::Wgmma(t) if t.channels == 96));
        assert!(matches!(kernel(TensorCoreMath::Bf16, 384, true), ConvKernel::Wgmma(t) if t.channels == 192));
        // Without the kernels (not compute capability 9.0), fewer channels, other products.
        assert!(matches!(kernel(TensorCoreMath::Bf16, 96, false), ConvKernel::TensorCores(_)));
        assert!(matches!(kernel(TensorCoreMath::Bf16, 64, true), ConvKernel::TensorCores(_)));
        assert!(matches!(kernel(TensorCoreMath::F32, 96, true), ConvKernel::TensorCores(_)));
        assert!(matches!(kernel(TensorCoreMath::Tf32, 96, true), ConvKernel::TensorCores(_)));
        assert_eq!(kernel(TensorCoreMath::Bf16, 3, true), ConvKernel::SmallCout);
        // A thread that forces an mma.sync width gets it.
        let _narrow = ConvTilesGuard::enter(Some(ConvKernels::Pixels128));
        assert!(matches!(kernel(TensorCoreMath::Bf16, 96, true), ConvKernel::TensorCores(t) if t.pixels == 128));
    }

    #[test]
    fn a_guard_or_the_variable_routes_convolutions_to_cudnn() {
        assert_eq!(conv_env_says(Some("cudnn")), Some(ConvKernels::Cudnn));
        assert_eq!(conv_env_says(Some(" fastest ")), Some(ConvKernels::Fastest));
        for ours in [None, Some(""), Some("auto"), Some("128"), Some("wgmma"), Some("cuDNN!")] {
            assert_eq!(conv_env_says(ours), None, "{ours:?}");
        }
        let _cudnn = ConvTilesGuard::enter(Some(ConvKernels::Cudnn));
        assert_eq!(conv_route(), ConvRoute::Cudnn);
        // cuDNN forces no mma.sync width and no wgmma where ours run instead.
        assert_eq!(tensor_core_tile(TensorCoreMath::Bf16, 384, BIG, SMS).pixels, 256);
        assert!(matches!(
            conv_kernel(TensorCoreMath::Bf16, 96, 27 * 96, 2, BIG, SMS, true),
            ConvKernel::TensorCores(_)
        ));
        {
            let _fastest = ConvTilesGuard::enter(Some(ConvKernels::Fastest));
            assert_eq!(conv_route(), ConvRoute::Fastest);
        }
        assert_eq!(conv_route(), ConvRoute::Cudnn);
        let _tiles = ConvTilesGuard::enter(Some(ConvKernels::Pixels128));
        assert_eq!(conv_route(), ConvRoute::Ours);
    }

    #[test]
    fn the_wgmma_variable_turns_the_kernels_on_only_when_it_says_so() {
        for on in ["1", "true", "TRUE", "yes", "On", " 1 "] {
            assert!(wgmma_env_says(Some(on)), "{on:?}");
        }
        // Unset, off, and what is neither (a typo is not read as a yes).
        for off in ["", "0", "false", "No", "off", "2", "ture", "enable"] {
            assert!(!wgmma_env_says(Some(off)), "{off:?}");
        }
        assert!(!wgmma_env_says(None));
    }
}
