//! FP8 e4m3 on the host: the format of an e4m3 decode cache
//! ([`KvCacheDtype::E4m3`](crate::KvCacheDtype::E4m3)). One sign bit, four
//! exponent bits (bias 7), three mantissa bits; no infinities, and
//! `0x7f` / `0xff` are NaN, so the largest magnitude is 448
//! (`0x7e`) and the least 2⁻⁹ (`0x01`, subnormal). These are the bytes the
//! decode kernel reads and the CPU reference dequantizes.

/// The e4m3 byte nearest `x`, ties to even, saturating past ±448 (±∞
/// included) to ±448; NaN to NaN (`0x7f`, with its sign).
pub fn from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    if x.is_nan() {
        return sign | 0x7f;
    }
    let a = f64::from(x.abs());
    if a >= 448.0 {
        return sign | 0x7e;
    }
    // Values are multiples of 2^(e - 3) in binade e, and of 2^-9 below the
    // least normal (2^-6): round a to its binade's quantum, exactly in f64.
    let e = binade(a).max(-6);
    let quantum = 2f64.powi(e - 3);
    let v = (a / quantum).round_ties_even() * quantum;
    sign | encode(v.min(448.0))
}

/// The value of an e4m3 byte, exactly (NaN for `0x7f` and `0xff`).
pub fn to_f32(b: u8) -> f32 {
    let (exponent, mantissa) = (i32::from(b >> 3 & 0xf), f32::from(b & 7));
    let magnitude = match (exponent, mantissa) {
        (15, 7.0) => f32::NAN,
        (0, m) => m * 2f32.powi(-9),
        (e, m) => (1.0 + m / 8.0) * 2f32.powi(e - 7),
    };
    if b & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// `values` quantized for a cache whose descale factor is `descale`:
/// each byte is [`from_f32`] of `value / descale`.
pub fn quantize(values: &[f32], descale: f32) -> Vec<u8> {
    values.iter().map(|&x| from_f32(x / descale)).collect()
}

/// The descale factor that maps `values`' largest magnitude to 448 (1 for
/// values all zero): e4m3's whole range, nothing saturated.
pub fn descale_for(values: &[f32]) -> f32 {
    let amax = values.iter().fold(0f32, |m, x| m.max(x.abs()));
    if amax > 0.0 && amax.is_finite() {
        amax / 448.0
    } else {
        1.0
    }
}

/// `floor(log2(a))` of a positive finite `a` (an f32's, so never an f64
/// subnormal).
fn binade(a: f64) -> i32 {
    ((a.to_bits() >> 52) as i32) - 1023
}

/// The bits of a magnitude `v` that e4m3 represents exactly, at most 448.
fn encode(v: f64) -> u8 {
    if v < 2f64.powi(-6) {
        return (v * 512.0) as u8;
    }
    let e = binade(v);
    let mantissa = (v / 2f64.powi(e) - 1.0) * 8.0;
    (((e + 7) as u8) << 3) | mantissa as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host quantizer rounds as the reference's e4m3 baseline does
    /// (`reference::round_e4m3`), and every byte it writes reads back as
    /// that value.
    #[test]
    fn quantizing_agrees_with_the_reference_rounding() {
        let mut x = 1e-4f32;
        while x < 600.0 {
            for v in [x, -x, x * 1.03125] {
                let rounded = flashgen_codegen::reference::round_e4m3(f64::from(v));
                assert_eq!(f64::from(to_f32(from_f32(v))), rounded, "{v}");
            }
            x *= 1.07;
        }
    }

    #[test]
    fn known_values_have_their_bit_patterns() {
        for (x, bits) in [
            (0.0, 0x00),
            (-0.0, 0x80),
            (1.0, 0x38),
            (-1.0, 0xb8),
            (1.125, 0x39),
            (0.5, 0x30),
            (240.0, 0x77),
            (448.0, 0x7e),
            (-448.0, 0xfe),
            (2f32.powi(-6), 0x08),
            (2f32.powi(-9), 0x01),
            (7.0 * 2f32.powi(-9), 0x07),
            (0.3, 0x2a),
        ] {
            assert_eq!(from_f32(x), bits, "{x}");
        }
    }

    #[test]
    fn ties_round_to_even() {
        assert_eq!(from_f32(1.0625), 0x38, "1 + 1/16: between 1 (even) and 1.125");
        assert_eq!(from_f32(1.1875), 0x3a, "between 1.125 and 1.25 (even)");
        assert_eq!(from_f32(2f32.powi(-10)), 0x00, "half the least subnormal: to 0");
        assert_eq!(from_f32(3.0 * 2f32.powi(-10)), 0x02, "1.5 least subnormals: to 2");
        assert_eq!(from_f32(15.5 * 2f32.powi(-10)), 0x08, "7.75 subnormals round up into the normals");
        assert_eq!(from_f32(1.0 + 1.0 / 16.0 + 1e-6), 0x39, "past the tie: up");
    }

    #[test]
    fn out_of_range_values_saturate() {
        for (x, bits) in [(464.0, 0x7e), (500.0, 0x7e), (f32::INFINITY, 0x7e), (-1e30, 0xfe), (f32::NEG_INFINITY, 0xfe)]
        {
            assert_eq!(from_f32(x), bits, "{x}");
        }
        assert_eq!(from_f32(f32::NAN), 0x7f);
        assert!(to_f32(0x7f).is_nan() && to_f32(0xff).is_nan());
    }

    #[test]
    fn every_byte_round_trips() {
        for b in (0..=255u8).filter(|b| b & 0x7f != 0x7f) {
            assert_eq!(from_f32(to_f32(b)), b, "{b:#04x} = {}", to_f32(b));
        }
        assert_eq!(to_f32(0x7e), 448.0);
        assert_eq!(to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn quantizing_divides_by_the_descale() {
        let values = [0.0, 3.5, -7.0];
        let descale = descale_for(&values);
        assert_eq!(descale, 7.0 / 448.0);
        assert_eq!(quantize(&values, descale), vec![0x00, 0x76, 0xfe]);
        assert_eq!(descale_for(&[0.0]), 1.0);
    }
}
