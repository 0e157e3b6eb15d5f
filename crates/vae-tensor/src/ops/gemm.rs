//! A bounds-checked wrapper over `gemm::gemm` for f32.
//!
//! `gemm` takes raw pointers and strides. Every call in this crate goes through [`matmul_into`],
//! which checks that each matrix, with its offset and strides, lies inside its slice before the
//! unsafe call, so a wrong stride becomes an error instead of undefined behaviour.

use crate::{Result, TensorError};

/// A read-only strided matrix view into a slice.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    /// Backing elements.
    pub data: &'a [f32],
    /// Index of element (0, 0).
    pub offset: usize,
    /// Distance between rows.
    pub rs: usize,
    /// Distance between columns.
    pub cs: usize,
}

/// A mutable strided matrix view into a slice.
pub(crate) struct MatMut<'a> {
    /// Backing elements.
    pub data: &'a mut [f32],
    /// Index of element (0, 0).
    pub offset: usize,
    /// Distance between rows.
    pub rs: usize,
    /// Distance between columns.
    pub cs: usize,
}

/// True when a `rows × cols` matrix at `offset` with strides `rs`, `cs` lies inside `len`.
fn fits(len: usize, offset: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    if rows == 0 || cols == 0 {
        return true;
    }
    let last = (rows - 1).checked_mul(rs).zip((cols - 1).checked_mul(cs)).and_then(|(a, b)| a.checked_add(b));
    let last = last.and_then(|l| l.checked_add(offset));
    // Strides must also fit `isize`, the type gemm takes.
    matches!(last, Some(l) if l < len) && isize::try_from(rs.max(cs)).is_ok()
}

/// The threading to give gemm: the current rayon pool's size, so a caller sizes it by
/// installing a pool (each rank thread can run in its own).
pub(crate) fn parallelism() -> gemm::Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// `dst = scale · lhs · rhs` (or `dst += scale · lhs · rhs` when `accumulate`) for an
/// `m × k` lhs and a `k × n` rhs, with `[m, n, k] = mnk`, on the current rayon pool.
pub(crate) fn matmul_into(
    mnk: [usize; 3],
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    accumulate: bool,
    scale: f32,
) -> Result<()> {
    matmul_into_with(parallelism(), mnk, dst, lhs, rhs, accumulate, scale)
}

/// [`matmul_into`] with explicit threading, for callers that already run in parallel.
pub(crate) fn matmul_into_with(
    par: gemm::Parallelism,
    [m, n, k]: [usize; 3],
    dst: MatMut<'_>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    accumulate: bool,
    scale: f32,
) -> Result<()> {
    let ok = fits(dst.data.len(), dst.offset, m, n, dst.rs, dst.cs)
        && fits(lhs.data.len(), lhs.offset, m, k, lhs.rs, lhs.cs)
        && fits(rhs.data.len(), rhs.offset, k, n, rhs.rs, rhs.cs);
    if !ok {
        return Err(TensorError::InvalidArgument {
            op: "gemm",
            reason: format!("a {m}x{k} · {k}x{n} product does not fit its buffers (internal stride error)"),
        });
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        // An empty sum; gemm's handling of k = 0 is not documented, so do it here.
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    dst.data[dst.offset + i * dst.rs + j * dst.cs] = 0.0;
                }
            }
        }
        return Ok(());
    }
    // SAFETY: `fits` checked above that every element each matrix addresses, at
    // `offset + i·rs + j·cs`, is inside its slice (and that strides fit `isize`). `dst` is a
    // unique borrow, so it cannot alias `lhs` or `rhs`. gemm reads `dst` only when
    // `read_dst` is true, and the slice is initialised either way.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr().add(dst.offset),
            dst.cs as isize,
            dst.rs as isize,
            accumulate,
            lhs.data.as_ptr().add(lhs.offset),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr().add(rhs.offset),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_out_of_bounds_views() {
        let a = [1.0f32; 4];
        let mut d = [0.0f32; 4];
        let lhs = MatRef { data: &a, offset: 0, rs: 2, cs: 1 };
        let rhs = MatRef { data: &a, offset: 1, rs: 2, cs: 1 };
        let dst = MatMut { data: &mut d, offset: 0, rs: 2, cs: 1 };
        assert!(matmul_into([2, 2, 2], dst, lhs, rhs, false, 1.0).is_err());
    }

    #[test]
    fn small_product_is_right() {
        // [1 2; 3 4] · [5 6; 7 8] = [19 22; 43 50]
        let a = [1.0f32, 2.0, 3.0, 4.0];
        let b = [5.0f32, 6.0, 7.0, 8.0];
        let mut d = [0.0f32; 4];
        let lhs = MatRef { data: &a, offset: 0, rs: 2, cs: 1 };
        let rhs = MatRef { data: &b, offset: 0, rs: 2, cs: 1 };
        matmul_into([2, 2, 2], MatMut { data: &mut d, offset: 0, rs: 2, cs: 1 }, lhs, rhs, false, 1.0).unwrap();
        assert_eq!(d, [19.0, 22.0, 43.0, 50.0]);
    }
}
