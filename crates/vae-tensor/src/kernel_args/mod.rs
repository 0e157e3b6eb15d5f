//! Typed launchers of the `kernels-cu/` entry points the CUDA backend runs: one argument struct
//! per kernel, whose fields are the kernel's parameters in the order and of the types its `.cu`
//! declaration gives, and one `launch` per struct that checks what the kernel asks of its
//! arguments (the storage types of its instantiation, the elements its accesses reach, the launch
//! shape where the kernel depends on it) and then queues it in its one `unsafe` block. A
//! `cudarc` launch is unsafe because nothing ties the pushed arguments to the kernel: these
//! structs are that tie, and the backend's op code launches through them only.
//!
//! A struct is declared once, in C terms, by [`kernel_args!`]: `[const T*]` is a buffer the
//! kernel reads ([`DataView`]), `[T*]` one it writes ([`DataViewMut`]), `[u64]` a 64-bit scalar,
//! and so on. The same declaration gives the fields, the order they are pushed in, and
//! [`KernelArgs::PARAMS`], which a test compares with the declarations it parses out of
//! `kernels-cu/*.cu` (names, order, pointer or scalar, constness, element and scalar types), so a
//! kernel whose signature drifts fails `cargo test` on a machine without a GPU. Constness matters
//! beyond the kernel: cudarc orders a launch after the last write of every buffer pushed, and
//! after its reads too for the buffers pushed as written, so a written buffer pushed as `const`
//! would lose that order on a second stream.
//!
//! Kernels written once over a storage type `T` (and GEMM's `TA`, `TB`, `TC`) list their
//! instantiations ([`Instance`]); a launcher picks the one its operands' storage types select, or
//! checks the one its caller chose (the convolution tiles).

mod attention;
mod conv;
mod elementwise;
mod gemm;
mod layout;
mod norm;
#[cfg(test)]
mod signatures;

pub(crate) use attention::{SoftmaxRows, SoftmaxRowsToBf16};
pub(crate) use conv::{ConvInput, ConvInputSplit, ConvProduct, ConvWeight};
pub(crate) use elementwise::{Add, Affine, Cast, Clamp, Silu, SiluInto};
pub(crate) use gemm::GemmBatched;
pub(crate) use layout::{AvgDown3d, CopyBox, DupUp3d, UpsampleNearest};
pub(crate) use norm::{GroupNormApply, GroupNormPartials, GroupNormStats, RmsNorm, RmsNormX4};

use cudarc::driver::{CudaFunction, CudaSlice, DriverError, LaunchArgs, LaunchConfig, PushKernelArg};

use crate::abi::{Box8, ConvGeom};
use crate::cuda::backend::{CudaDevice, driver};
pub(crate) use crate::cuda::backend::{DataView, DataViewMut};
use crate::cuda::kernels::{Kernel, Typed};
use crate::{DType, TensorError};

/// The C type of one kernel parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Param {
    /// A pointer to elements of `elem`; `mutable` false for a `const` one.
    Ptr {
        /// What it points at.
        elem: Elem,
        /// Whether the kernel may write through it.
        mutable: bool,
    },
    /// `u64` (`unsigned long long`).
    U64,
    /// `i64` (`long long`).
    I64,
    /// `float`.
    F32,
    /// `int`.
    I32,
    /// A by-value struct of [`crate::abi`], by its C name.
    Struct(&'static str),
}

/// The elements a pointer parameter points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Elem {
    /// A type parameter of a kernel written once over storage types (`T`, `TA`, ...): each
    /// [`Instance`] says which storage type it is.
    Type(&'static str),
    /// `float`.
    F32,
    /// `unsigned short`: bf16 bits.
    Bf16,
    /// `double`.
    F64,
}

/// One instantiation of a kernel: its entry point and the storage type of each of its type
/// parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Instance {
    /// The entry point.
    pub(crate) kernel: Kernel,
    /// `(type parameter, storage type)` pairs.
    pub(crate) types: &'static [(&'static str, DType)],
}

/// `T` as f32 storage.
const T_F32: &[(&str, DType)] = &[("T", DType::F32)];
/// `T` as bf16 storage.
const T_BF16: &[(&str, DType)] = &[("T", DType::BF16)];

/// The two instantiations of a kernel written once over its storage type `T`.
const fn typed(kernel: Typed) -> [Instance; 2] {
    [Instance { kernel: kernel.f32, types: T_F32 }, Instance { kernel: kernel.bf16, types: T_BF16 }]
}

impl Elem {
    /// The storage type of these elements in `instance`: `Some(None)` for elements of no
    /// storage type (f64 scratch), `None` where `instance` does not name the type parameter.
    fn storage(self, instance: &Instance) -> Option<Option<DType>> {
        match self {
            Self::Type(name) => instance.types.iter().find(|(t, _)| *t == name).map(|&(_, d)| Some(d)),
            Self::F32 => Some(Some(DType::F32)),
            Self::Bf16 => Some(Some(DType::BF16)),
            Self::F64 => Some(None),
        }
    }
}

/// Why a typed launch failed.
#[derive(Debug)]
pub(crate) enum LaunchError {
    /// The arguments break the kernel's contract, or its function did not load: nothing was
    /// queued.
    Invalid(TensorError),
    /// The driver failed the launch.
    Driver(DriverError),
}

impl From<TensorError> for LaunchError {
    fn from(e: TensorError) -> Self {
        Self::Invalid(e)
    }
}

impl LaunchError {
    /// As a tensor error of `op` on device `ordinal` (a driver failure is reported as the op's,
    /// like the other driver errors of the backend).
    pub(crate) fn into_tensor(self, ordinal: usize, op: &'static str) -> TensorError {
        match self {
            Self::Invalid(e) => e,
            Self::Driver(e) => driver(ordinal, op, e),
        }
    }
}

/// An argument error of `kernel`.
fn invalid(kernel: Kernel, reason: String) -> LaunchError {
    LaunchError::Invalid(TensorError::InvalidArgument { op: kernel.name, reason })
}

/// An error of `kernel` unless `ok`.
fn require(kernel: Kernel, ok: bool, reason: impl FnOnce() -> String) -> Result<(), LaunchError> {
    if ok { Ok(()) } else { Err(invalid(kernel, reason())) }
}

/// The product of `dims`, `None` on overflow.
fn product(dims: &[u64]) -> Option<u64> {
    dims.iter().try_fold(1u64, |p, &d| p.checked_mul(d))
}

/// An error of `kernel` unless `len` elements of `what` hold the `needed` (`None`: more than
/// 2^64) that its accesses reach from the start of `what`.
fn holds(kernel: Kernel, what: &str, len: usize, needed: Option<u64>) -> Result<(), LaunchError> {
    match needed {
        Some(n) if n <= len as u64 => Ok(()),
        Some(n) => Err(invalid(kernel, format!("{what} holds {len} elements, the kernel reaches {n}"))),
        None => Err(invalid(kernel, format!("{what}: the elements the kernel reaches overflow 64 bits"))),
    }
}

/// The offsets from a buffer's start that a walk over `extent` with `stride` reaches, lowest and
/// highest (extents at least 1).
fn reach(extent: &[u64], stride: &[i64]) -> (i128, i128) {
    extent.iter().zip(stride).fold((0, 0), |(lo, hi), (&e, &s)| {
        let last = (i128::from(e) - 1) * i128::from(s);
        (lo + last.min(0), hi + last.max(0))
    })
}

/// An error of `kernel` unless `len` elements from a view's start hold the offsets `(lo, hi)`.
fn holds_offsets(kernel: Kernel, what: &str, len: usize, (lo, hi): (i128, i128)) -> Result<(), LaunchError> {
    require(kernel, lo >= 0 && hi < len as i128, || {
        format!("{what} holds {len} elements, the kernel reaches {lo}..={hi}")
    })
}

/// An error of `kernel` unless `cfg`'s blocks are one-dimensional, of a multiple of 32 threads
/// and at most `most`: what the block-wide reductions of `common.cuh` (a whole warp per
/// shuffle, one shared slot per warp) and the launch bounds allow.
fn whole_warps(kernel: Kernel, cfg: &LaunchConfig, most: u32) -> Result<(), LaunchError> {
    let (x, y, z) = cfg.block_dim;
    require(kernel, x > 0 && x % 32 == 0 && x <= most && y == 1 && z == 1, || {
        format!("blocks of {:?} threads; the kernel takes 1-D blocks of whole warps, at most {most}", cfg.block_dim)
    })
}

/// The fields of a kernel's argument struct: its parameters, in order.
pub(crate) trait KernelArgs {
    /// The parameters, by name, as the `.cu` declares them.
    const PARAMS: &'static [(&'static str, Param)];

    /// Pushes every field, in declaration order.
    fn push<'s>(&'s mut self, builder: &mut LaunchArgs<'s>);

    /// The storage type of field `index` where it is a storage buffer (and not null).
    fn dtype(&self, index: usize) -> Option<DType>;

    /// Whether every storage buffer has the storage type `instance` gives its parameter.
    fn fits(&self, instance: &Instance) -> bool {
        Self::PARAMS.iter().enumerate().all(|(i, (_, param))| match param {
            Param::Ptr { elem, .. } => match elem.storage(instance) {
                Some(Some(want)) => self.dtype(i).is_none_or(|got| got == want),
                Some(None) => true,
                None => false,
            },
            _ => true,
        })
    }

    /// The storage types of the storage buffers, for messages.
    fn dtypes(&self) -> String {
        let types: Vec<String> = (0..Self::PARAMS.len()).filter_map(|i| self.dtype(i)).map(|d| d.to_string()).collect();
        types.join(", ")
    }
}

/// The instantiation among `instances` that `args`' storage types select.
fn select<A: KernelArgs>(args: &A, instances: &[Instance]) -> Result<Instance, LaunchError> {
    instances.iter().copied().find(|i| args.fits(i)).ok_or_else(|| {
        let names: Vec<&str> = instances.iter().map(|i| i.kernel.name).collect();
        invalid(instances[0].kernel, format!("none of {names:?} takes operands of {}", args.dtypes()))
    })
}

/// An error unless `args`' storage types are the ones `instance` takes.
fn check_types<A: KernelArgs>(args: &A, instance: &Instance) -> Result<(), LaunchError> {
    require(instance.kernel, args.fits(instance), || {
        format!("operands of {} do not match the kernel's {:?}", args.dtypes(), instance.types)
    })
}

/// Queues `f` with `args` under `cfg` on the calling thread's stream of `device`.
///
/// # Safety
/// `f` is the entry point of an instantiation that `A` declares (`A::PARAMS` is its parameter
/// list, and `args` fit its storage types), and every access the kernel makes under `cfg` from
/// these arguments stays inside the buffers they point at.
unsafe fn enqueue<A: KernelArgs>(
    mut args: A,
    device: &CudaDevice,
    f: &CudaFunction,
    cfg: LaunchConfig,
) -> Result<(), LaunchError> {
    let stream = device.stream();
    let mut builder = stream.launch_builder(f);
    args.push(&mut builder);
    // SAFETY: the pushes are `A`'s fields in declaration order, `f`'s parameters with their
    // types and constness; that every access stays inside the buffers is the caller's contract.
    // The buffers' events order the launch after their last writers, and stay borrowed (so
    // alive) until it is queued; cudarc frees none before the work queued on them has run.
    unsafe { builder.launch(cfg) }.map_err(LaunchError::Driver)?;
    Ok(())
}

/// A null device pointer, for an optional pointer parameter given none.
static NULL: u64 = 0;

/// How a field goes into a launch, and its storage type where it is a storage buffer.
trait Arg {
    /// Pushes the field as its parameter.
    fn push<'s>(&'s mut self, builder: &mut LaunchArgs<'s>);

    /// The storage type of a storage buffer.
    fn dtype(&self) -> Option<DType> {
        None
    }
}

impl Arg for DataView<'_> {
    fn push<'s>(&'s mut self, builder: &mut LaunchArgs<'s>) {
        builder.arg(&*self);
    }
    fn dtype(&self) -> Option<DType> {
        Some(DataView::dtype(self))
    }
}

impl Arg for DataViewMut<'_> {
    fn push<'s>(&'s mut self, builder: &mut LaunchArgs<'s>) {
        builder.arg(self);
    }
    fn dtype(&self) -> Option<DType> {
        Some(DataViewMut::dtype(self))
    }
}

impl Arg for Option<DataView<'_>> {
    fn push<'s>(&'s mut self, builder: &mut LaunchArgs<'s>) {
        match self {
            Some(view) => builder.arg(&*view),
            None => builder.arg(&NULL),
        };
    }
    fn dtype(&self) -> Option<DType> {
        self.as_ref().map(DataView::dtype)
    }
}

impl Arg for &CudaSlice<f64> {
    fn push<'s>(&'s mut self, builder: &mut LaunchArgs<'s>) {
        builder.arg(&**self);
    }
}

impl Arg for &mut CudaSlice<f64> {
    fn push<'s>(&'s mut self, builder: &mut LaunchArgs<'s>) {
        builder.arg(&mut **self);
    }
}

macro_rules! scalar_args {
    ($($t:ty),*) => {
        $(impl Arg for $t {
            fn push<'s>(&'s mut self, builder: &mut LaunchArgs<'s>) {
                builder.arg(&*self);
            }
        })*
    };
}

scalar_args!(u64, i64, f32, i32, ConvGeom, Box8);

/// The Rust type, [`Param`] or [`Elem`] of a parameter's C type (see [`kernel_args!`]).
macro_rules! c_type {
    (rust $l:lifetime; const double *) => { &$l ::cudarc::driver::CudaSlice<f64> };
    (rust $l:lifetime; double *) => { &$l mut ::cudarc::driver::CudaSlice<f64> };
    (rust $l:lifetime; Option<const $($e:ident)+ *>) => { Option<$crate::kernel_args::DataView<$l>> };
    (rust $l:lifetime; const $($e:ident)+ *) => { $crate::kernel_args::DataView<$l> };
    (rust $l:lifetime; $($e:ident)+ *) => { $crate::kernel_args::DataViewMut<$l> };
    (rust $l:lifetime; u64) => { u64 };
    (rust $l:lifetime; i64) => { i64 };
    (rust $l:lifetime; float) => { f32 };
    (rust $l:lifetime; int) => { i32 };
    (rust $l:lifetime; $s:ident) => { $crate::abi::$s };
    (param; Option<const $($e:ident)+ *>) => {
        $crate::kernel_args::Param::Ptr { elem: $crate::kernel_args::c_type!(elem; $($e)+), mutable: false }
    };
    (param; const $($e:ident)+ *) => {
        $crate::kernel_args::Param::Ptr { elem: $crate::kernel_args::c_type!(elem; $($e)+), mutable: false }
    };
    (param; $($e:ident)+ *) => {
        $crate::kernel_args::Param::Ptr { elem: $crate::kernel_args::c_type!(elem; $($e)+), mutable: true }
    };
    (param; u64) => { $crate::kernel_args::Param::U64 };
    (param; i64) => { $crate::kernel_args::Param::I64 };
    (param; float) => { $crate::kernel_args::Param::F32 };
    (param; int) => { $crate::kernel_args::Param::I32 };
    (param; $s:ident) => { $crate::kernel_args::Param::Struct(stringify!($s)) };
    (elem; float) => { $crate::kernel_args::Elem::F32 };
    (elem; unsigned short) => { $crate::kernel_args::Elem::Bf16 };
    (elem; double) => { $crate::kernel_args::Elem::F64 };
    (elem; $t:ident) => { $crate::kernel_args::Elem::Type(stringify!($t)) };
}

/// Declares argument structs, each field with its parameter's C type in brackets: `[const T*]`
/// (read; `T` a type parameter, or `float`, `unsigned short`, `double`), `[T*]` (written),
/// `[Option<const float*>]` (read, or null), `[u64]`, `[i64]`, `[float]`, `[int]`, or a struct
/// of [`crate::abi`] (`[ConvGeom]`). Fields are named as the `.cu` names the parameters (`box`
/// as `r#box`, case aside).
macro_rules! kernel_args {
    ($(
        $(#[$doc:meta])*
        struct $name:ident<$l:lifetime> {
            $($field:ident: [$($c:tt)+]),* $(,)?
        }
    )*) => {$(
        $(#[$doc])*
        pub(crate) struct $name<$l> {
            $(pub(crate) $field: $crate::kernel_args::c_type!(rust $l; $($c)+),)*
        }

        impl $crate::kernel_args::KernelArgs for $name<'_> {
            const PARAMS: &'static [(&'static str, $crate::kernel_args::Param)] =
                &[$((stringify!($field), $crate::kernel_args::c_type!(param; $($c)+))),*];

            fn push<'s>(&'s mut self, builder: &mut ::cudarc::driver::LaunchArgs<'s>) {
                $($crate::kernel_args::Arg::push(&mut self.$field, builder);)*
            }

            fn dtype(&self, index: usize) -> Option<$crate::DType> {
                let dtypes = [$($crate::kernel_args::Arg::dtype(&self.$field)),*];
                dtypes.get(index).copied().flatten()
            }
        }
    )*};
}

pub(crate) use {c_type, kernel_args};

/// An argument struct, for the signature test: its name, parameters and the instantiations it
/// launches.
#[cfg(test)]
pub(crate) struct Declared {
    pub(crate) name: &'static str,
    pub(crate) params: &'static [(&'static str, Param)],
    pub(crate) instances: Vec<Instance>,
}

/// Every argument struct.
#[cfg(test)]
pub(crate) fn declared() -> Vec<Declared> {
    fn entry<A: KernelArgs>(instances: &[Instance]) -> Declared {
        let name = std::any::type_name::<A>().split('<').next().and_then(|p| p.rsplit("::").next()).unwrap_or("?");
        Declared { name, params: A::PARAMS, instances: instances.to_vec() }
    }
    vec![
        entry::<Add>(&elementwise::ADD),
        entry::<Affine>(&elementwise::AFFINE),
        entry::<Silu>(&elementwise::SILU),
        entry::<SiluInto>(&elementwise::SILU_INTO),
        entry::<Clamp>(&elementwise::CLAMP),
        entry::<Cast>(&elementwise::CAST),
        entry::<RmsNorm>(&norm::RMS_NORM),
        entry::<RmsNormX4>(&norm::RMS_NORM_X4),
        entry::<GroupNormPartials>(&norm::GROUP_NORM_PARTIALS),
        entry::<GroupNormStats>(&norm::GROUP_NORM_STATS),
        entry::<GroupNormApply>(&norm::GROUP_NORM_APPLY),
        entry::<ConvInput>(&conv::CONV_INPUT),
        entry::<ConvInputSplit>(&conv::CONV_INPUT_SPLIT),
        entry::<ConvWeight>(&conv::CONV_WEIGHT),
        entry::<ConvProduct>(&conv::products()),
        entry::<UpsampleNearest>(&layout::UPSAMPLE_NEAREST),
        entry::<CopyBox>(&layout::COPY_BOX),
        entry::<DupUp3d>(&layout::DUP_UP3D),
        entry::<AvgDown3d>(&layout::AVG_DOWN3D),
        entry::<SoftmaxRows>(&attention::SOFTMAX_ROWS),
        entry::<SoftmaxRowsToBf16>(&attention::SOFTMAX_ROWS_TO_BF16),
        entry::<GemmBatched>(&gemm::GEMM_BATCHED),
    ]
}
