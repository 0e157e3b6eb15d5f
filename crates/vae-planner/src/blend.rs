//! The linear cross-fade diffusers applies between neighbouring tiles.
//!
//! diffusers' `blend_v` / `blend_h` do, for `y in range(e)`:
//!
//! ```text
//! b[y] = a[H_a - e + y] * (1 - y / e) + b[y] * (y / e)
//! ```
//!
//! where `a` is the previous tile's output (along the blended axis), `b` the
//! current one and `e = min(H_a, H_b, blend_extent)`.
//!
//! Two facts matter for bit-exact reproduction:
//!
//! * **Rounding.** `y / e` and `1 - y / e` are Python floats (f64). PyTorch
//!   casts such a scalar to the tensor's compute type (f32) before the
//!   multiply, rounds each product to f32, then rounds their sum: two products
//!   and one add, no fused multiply-add. [`BlendRamp`] stores the f32-cast
//!   weights and [`blend_value`] performs exactly those operations.
//! * **Order.** The blend reads the *last* `e` rows of the previous tile as it
//!   is at that moment (already blended with its own predecessors) and
//!   overwrites the *first* `e` rows of the current tile in place. Later
//!   blends then read those modified rows, so the row-major scan order of
//!   diffusers (vertical blend, then horizontal blend, tile by tile) is part
//!   of the result and must be replayed as is.

/// Per-row weights `(prev_weight, cur_weight)` of one blend of extent `e`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlendRamp {
    weights: Vec<(f32, f32)>,
}

impl BlendRamp {
    /// Weights for a blend over `extent` rows (`extent` is the already
    /// clamped `e`; 0 gives an empty ramp, i.e. no blending).
    #[must_use]
    pub fn new(extent: usize) -> Self {
        let e = extent as f64;
        let weights = (0..extent)
            .map(|y| {
                // Same f64 expressions as Python, then the f32 cast PyTorch
                // applies to a Python scalar multiplied into an f32 tensor.
                let t = y as f64 / e;
                ((1.0 - t) as f32, t as f32)
            })
            .collect();
        Self { weights }
    }

    /// Number of blended rows `e`.
    #[must_use]
    pub fn len(&self) -> usize {
        self.weights.len()
    }

    /// Whether the ramp blends nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.weights.is_empty()
    }

    /// `(prev_weight, cur_weight)` for rows `0..e`.
    #[must_use]
    pub fn weights(&self) -> &[(f32, f32)] {
        &self.weights
    }

    /// Weights of row `y`, or `None` past the ramp.
    #[must_use]
    pub fn weight(&self, y: usize) -> Option<(f32, f32)> {
        self.weights.get(y).copied()
    }

    /// Blended value of row `y` (see [`blend_value`]); `None` past the ramp.
    #[must_use]
    pub fn blend(&self, prev: f32, cur: f32, y: usize) -> Option<f32> {
        self.weight(y).map(|w| blend_value(prev, cur, w))
    }
}

/// Scalar reference of one blended element: `prev * w_prev + cur * w_cur`,
/// with each product rounded to f32 before the (rounded) sum, exactly as
/// PyTorch evaluates the diffusers expression on f32 tensors.
///
/// `prev` is the previous tile's element at row `H_a - e + y`, `cur` the
/// current tile's element at row `y`, and `weights` is
/// `BlendRamp::new(e).weights()[y]`.
#[must_use]
#[inline]
pub fn blend_value(prev: f32, cur: f32, (w_prev, w_cur): (f32, f32)) -> f32 {
    // Separate statements document the intent: two roundings, no FMA
    // (Rust never contracts `a * b + c` into an FMA on its own either).
    let a = prev * w_prev;
    let b = cur * w_cur;
    a + b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_ramp() {
        let r = BlendRamp::new(0);
        assert!(r.is_empty());
        assert_eq!(r.len(), 0);
        assert_eq!(r.weight(0), None);
    }

    #[test]
    fn ramp_of_four() {
        let r = BlendRamp::new(4);
        assert_eq!(r.weights(), &[(1.0, 0.0), (0.75, 0.25), (0.5, 0.5), (0.25, 0.75)]);
    }

    #[test]
    fn weights_are_rounded_from_f64() {
        // 1/3 is not representable: the f32 weights are the f32 roundings of
        // the f64 values, not f32 arithmetic on f32 operands.
        let r = BlendRamp::new(3);
        let (p, c) = r.weights()[1];
        assert_eq!(c, (1.0f64 / 3.0) as f32);
        assert_eq!(p, (1.0f64 - 1.0 / 3.0) as f32);
    }

    #[test]
    fn blend_value_formula() {
        let r = BlendRamp::new(4);
        assert_eq!(r.blend(8.0, 4.0, 1), Some(8.0 * 0.75 + 4.0 * 0.25));
        assert_eq!(r.blend(8.0, 4.0, 0), Some(8.0));
        assert_eq!(r.blend(8.0, 4.0, 4), None);
        let w = BlendRamp::new(7).weights()[3];
        let (p, c) = (1.234_567_f32, -7.654_321_f32);
        let expected = {
            let a = p * w.0;
            let b = c * w.1;
            a + b
        };
        assert_eq!(blend_value(p, c, w).to_bits(), expected.to_bits());
    }
}
