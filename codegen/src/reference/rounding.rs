//! Rounding to the 16-bit storage types, round to nearest even.
//!
//! `half` rounds f32 correctly but truncates an f64's low 32 bits (or goes
//! through f32 with round-to-nearest) first, which can turn a value just above
//! a tie into a tie. Narrowing to f32 with round-to-odd first keeps the sticky
//! information, so the second rounding is exact (f32 has more than 2 bits
//! beyond either target's significand).

use crate::spec::Dtype;
use half::{bf16, f16};

/// Rounds to the nearest f16 (ties to even). f32 inputs widen exactly.
pub fn round_f16(x: f64) -> f64 {
    f16::from_f32(to_f32_odd(x)).to_f64()
}

/// Rounds to the nearest bf16 (ties to even). f32 inputs widen exactly.
pub fn round_bf16(x: f64) -> f64 {
    bf16::from_f32(to_f32_odd(x)).to_f64()
}

/// Rounds to the nearest value of `dtype`.
pub fn round_dtype(dtype: Dtype, x: f64) -> f64 {
    match dtype {
        Dtype::F16 => round_f16(x),
        Dtype::Bf16 => round_bf16(x),
    }
}

/// The values a same-dtype emulation rounds its intermediates to: a 16-bit
/// dtype's, all scaled by 2^(−shift / shifts). A scaled grid is exactly as
/// precise as the dtype's own, but its rounding points fall elsewhere, so
/// emulations on grids `0..shifts` are independent draws of the same kind of
/// rounding error (grid 0 is the dtype itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Grid {
    pub dtype: Dtype,
    shift: u32,
    shifts: u32,
    /// An e4m3 forward's emulation: its inputs are e4m3 values already
    /// (taken as they are), and P is rounded to e4m3 for P·V.
    pub e4m3: bool,
}

impl Grid {
    /// The dtype's own values.
    pub fn of(dtype: Dtype) -> Grid {
        Grid { dtype, shift: 0, shifts: 1, e4m3: false }
    }

    /// [`Grid::of`] for an e4m3 forward (see [`Grid::e4m3`](Grid)).
    pub fn e4m3(dtype: Dtype) -> Grid {
        Grid { e4m3: true, ..Grid::of(dtype) }
    }

    /// The `shift`-th of `shifts` grids spread evenly over one binade.
    pub fn shifted(dtype: Dtype, shift: u32, shifts: u32) -> Grid {
        Grid { dtype, shift, shifts, e4m3: false }
    }

    /// An input as the emulation reads it: rounded to the dtype, unless
    /// it is e4m3 already.
    pub fn load(self, x: f64) -> f64 {
        match self.e4m3 {
            true => x,
            false => round_dtype(self.dtype, x),
        }
    }

    /// P as P·V reads it: on the grid, or rounded to e4m3.
    pub fn round_p(self, x: f64) -> f64 {
        match self.e4m3 {
            true => round_e4m3(x),
            false => self.round(x),
        }
    }

    /// This grid with `dtype`'s values in place of its own, scaled alike.
    pub fn with_dtype(self, dtype: Dtype) -> Grid {
        Grid { dtype, ..self }
    }

    /// Rounds to the nearest grid value (ties to even on the scaled values).
    pub fn round(self, x: f64) -> f64 {
        let scale = (f64::from(self.shift) / f64::from(self.shifts)).exp2();
        round_dtype(self.dtype, x * scale) / scale
    }
}

/// Rounds to the nearest e4m3 value (ties to even), saturating at ±448
/// as the kernels' `cvt.rn.satfinite` does: 3 mantissa bits, exponents
/// down to −6, subnormals in steps of 2^−9.
pub fn round_e4m3(x: f64) -> f64 {
    if x == 0.0 || x.is_nan() {
        return x;
    }
    let exponent = x.abs().log2().floor().max(-6.0);
    let step = (exponent - 3.0).exp2();
    ((x / step).round_ties_even() * step).clamp(-448.0, 448.0)
}

/// f64 → f32 rounding to odd: truncate toward zero, then set the last bit if
/// anything was lost.
fn to_f32_odd(x: f64) -> f32 {
    let nearest = x as f32;
    if f64::from(nearest) == x || x.is_nan() {
        return nearest;
    }
    let mut bits = nearest.to_bits();
    if f64::from(nearest).abs() > x.abs() {
        bits -= 1; // One step toward zero: the truncation.
    }
    f32::from_bits(bits | 1)
}
