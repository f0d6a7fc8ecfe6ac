//! Error metrics and FlashAttention's acceptance rule.

use std::fmt;

/// Forward outputs may be off by twice the same-dtype reference's error.
pub const FORWARD_FACTOR: f64 = 2.0;
/// Gradients get three times.
pub const BACKWARD_FACTOR: f64 = 3.0;
/// Same-dtype baselines a gradient's tolerance averages over
/// ([`flash_rule_averaged`]).
pub const BACKWARD_BASELINES: u32 = 16;
/// Absolute slack, so that exact references do not demand exact results.
pub const FLASH_SLACK: f64 = 1e-6;
/// The slack also covers this many f32 units in the last place of the
/// golden's largest magnitude: a kernel's f32 results (the LSE, f32
/// gradients) are rounded to f32 and built from approximate exp2 and log2,
/// so where a same-dtype reference happens to be exact (the LSE of rows a
/// large sink dominates: 1e-6 is less than one ulp from 8 on) they still
/// differ from the golden by a few ulps.
pub const F32_ULPS: f64 = 4.0;

/// |a − b| with equal values (equal infinities included) at 0; NaN stays NaN.
fn abs_diff(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs()
    }
}

/// The largest elementwise |a − b|; NaN if any difference is NaN or the
/// lengths differ, so that a NaN can never pass a tolerance.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::NAN;
    }
    a.iter().zip(b).map(|(&x, &y)| abs_diff(x, y)).fold(0.0, |max, d| if d > max || d.is_nan() { d } else { max })
}

/// The mean elementwise |a − b| (0 for empty slices); NaN like
/// [`max_abs_diff`].
pub fn mean_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::NAN;
    }
    let total: f64 = a.iter().zip(b).map(|(&x, &y)| abs_diff(x, y)).sum();
    if a.is_empty() {
        0.0
    } else {
        total / a.len() as f64
    }
}

/// The outcome of [`flash_rule`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlashCheck {
    /// max |out − golden|.
    pub error: f64,
    /// max |same_dtype − golden|: what a same-dtype implementation loses
    /// (the mean over baselines for [`flash_rule_averaged`]).
    pub reference_error: f64,
    /// factor · reference_error + the slack ([`FLASH_SLACK`], or
    /// [`F32_ULPS`] of the golden's largest magnitude where that is more).
    pub tolerance: f64,
    pub passed: bool,
}

/// FlashAttention's test rule: a result passes iff
/// `max|out − golden| ≤ factor · max|same_dtype − golden| + 1e-6` (more
/// slack where a few f32 ulps of the golden exceed 1e-6: [`F32_ULPS`]), i.e. it
/// is at most `factor` times as wrong as a straightforward implementation in
/// the same dtype ([`FORWARD_FACTOR`] for outputs, [`BACKWARD_FACTOR`] for
/// gradients). A NaN anywhere never passes.
pub fn flash_rule(out: &[f64], same_dtype: &[f64], golden: &[f64], factor: f64) -> FlashCheck {
    flash_rule_averaged(out, [same_dtype], golden, factor)
}

/// [`flash_rule`] against the mean of `max|same_dtype − golden|` over
/// several same-dtype baselines whose roundings are independent draws (as
/// [`super::same_dtype_backwards`] makes them): an estimate of the error a
/// same-dtype implementation is expected to make. Over a large tensor one
/// draw of that maximum is already close to its mean; over a few elements
/// (a gradient of one f32 per head) it is not: a sum that nearly cancels can
/// come out almost exact by chance, and one such draw would demand a
/// near-exact kernel. Without baselines nothing passes.
pub fn flash_rule_averaged<'a>(
    out: &[f64],
    same_dtype: impl IntoIterator<Item = &'a [f64]>,
    golden: &[f64],
    factor: f64,
) -> FlashCheck {
    let error = max_abs_diff(out, golden);
    let (sum, count) =
        same_dtype.into_iter().fold((0.0, 0), |(sum, n), same| (sum + max_abs_diff(same, golden), n + 1));
    let reference_error = sum / f64::from(count);
    let largest = golden.iter().fold(0.0f64, |max, x| max.max(x.abs()));
    let slack = FLASH_SLACK.max(F32_ULPS * f64::from(f32::EPSILON) * largest);
    let tolerance = factor * reference_error + slack;
    FlashCheck { error, reference_error, tolerance, passed: error <= tolerance }
}

impl fmt::Display for FlashCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.passed { "ok" } else { "FAILED" };
        write!(
            f,
            "max error {:.3e}, tolerance {:.3e} (same-dtype reference error {:.3e}): {verdict}",
            self.error, self.tolerance, self.reference_error
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An f32 result one ulp off an exact reference at 23 (the LSE of a row
    /// a sink of 23 dominates) passes; ten times the slack does not; small
    /// magnitudes keep the 1e-6 floor.
    #[test]
    fn exact_references_allow_f32_rounding() {
        let golden = [23.0f64 + 1e-7, -1.5];
        let one_ulp = [f64::from(f32::from_bits((golden[0] as f32).to_bits() + 1)), -1.5];
        assert!(one_ulp[0] - golden[0] > FLASH_SLACK);
        assert!(flash_rule(&one_ulp, &golden, &golden, FORWARD_FACTOR).passed);
        let off = [golden[0] + 10.0 * F32_ULPS * f64::from(f32::EPSILON) * 23.0, -1.5];
        assert!(!flash_rule(&off, &golden, &golden, FORWARD_FACTOR).passed);
        let small = [0.5f64, -0.25];
        let check = flash_rule(&[0.5 + 2e-6, -0.25], &small, &small, FORWARD_FACTOR);
        assert_eq!((check.tolerance, check.passed), (FLASH_SLACK, false));
    }
}
