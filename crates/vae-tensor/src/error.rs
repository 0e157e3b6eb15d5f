//! The tensor error type.

use crate::{DType, Device, Shape};

/// What can go wrong in a tensor op. Every op checks its inputs and returns one of these
/// instead of panicking.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TensorError {
    /// Shapes that must agree do not.
    #[error("{op}: shape mismatch between {lhs} and {rhs}")]
    ShapeMismatch {
        /// The op.
        op: &'static str,
        /// First shape.
        lhs: Shape,
        /// Second shape.
        rhs: Shape,
    },
    /// A dimension index beyond the tensor's rank.
    #[error("{op}: dimension {dim} out of range for a tensor of shape {shape}")]
    DimOutOfRange {
        /// The op.
        op: &'static str,
        /// The dimension asked for.
        dim: usize,
        /// The tensor's shape.
        shape: Shape,
    },
    /// A range along a dimension that does not fit.
    #[error("{op}: range {start}..{end} of dimension {dim} out of bounds for shape {shape}")]
    RangeOutOfBounds {
        /// The op.
        op: &'static str,
        /// The dimension.
        dim: usize,
        /// Range start.
        start: usize,
        /// Range end.
        end: usize,
        /// The tensor's shape.
        shape: Shape,
    },
    /// A buffer whose length does not match the shape.
    #[error("{op}: shape {shape} needs {expected} elements, got {got}")]
    ElementCount {
        /// The op.
        op: &'static str,
        /// The shape.
        shape: Shape,
        /// Elements the shape needs.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// An op asked for an element type this backend does not implement.
    #[error("{op}: element type {dtype} is not supported on {device}")]
    UnsupportedDType {
        /// The op.
        op: &'static str,
        /// The element type.
        dtype: DType,
        /// The device.
        device: Device,
    },
    /// Tensors on different devices.
    #[error("{op}: tensors on different devices ({lhs} and {rhs})")]
    DeviceMismatch {
        /// The op.
        op: &'static str,
        /// First device.
        lhs: Device,
        /// Second device.
        rhs: Device,
    },
    /// A device this build or machine cannot use.
    #[error("device {device} unavailable: {reason}")]
    DeviceUnavailable {
        /// The device.
        device: Device,
        /// Why.
        reason: String,
    },
    /// Any other invalid argument.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The op.
        op: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = TensorError> = std::result::Result<T, E>;
