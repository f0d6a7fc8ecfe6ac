//! Dropout on the attention probabilities: which (q, k) pairs a launch
//! drops, on the CPU. The twin of `library/dropout.cuh`, bit for bit, so the
//! reference drops exactly the device's pairs.
//!
//! The mask is a pure function of (seed, offset, b, h, q, k): the forward
//! and the backward, which tile differently, regenerate the same one. One
//! Philox4x32-10 call (Salmon et al., "Parallel random numbers: as easy as
//! 1, 2, 3", Random123) draws four words for a 2 × 2 block of pairs,
//! queries `q & !1 ..= q | 1` times keys `k & !1 ..= k | 1`:
//!
//! - key: `(lo32(seed), hi32(seed) ^ hi32(offset))`;
//! - counter: `(k >> 1, q >> 1, b · heads + h, lo32(offset))`;
//! - pair (q, k) takes word `2 · (q & 1) + (k & 1)` and is dropped where the
//!   word is below [`Dropout::threshold`] (`floor(p · 2³²)`).
//!
//! A block's pairs share a call in both orientations of the kernels' tiles
//! (a thread holds two adjacent keys of a query row in the forward and the
//! dQ kernel, two adjacent queries of a key row in the dK/dV kernel). For
//! one seed, distinct offsets never give the same key and counter.

/// Dropout on the attention probabilities: each pair is dropped with
/// probability `p` (P is zeroed there) and kept ones are scaled by `1 / (1
/// − p)`, after the softmax: the LSE is dropout's no more than O's
/// normalizer, `O = (P ⊙ keep / (1 − p)) · V`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    /// The probability of dropping a pair, in `[0, 1)`.
    pub p: f32,
    /// The Philox key: one per training run, say.
    pub seed: u64,
    /// Selects an independent mask under the same seed: one per launch
    /// (layer and step), the same for a forward and its backward.
    pub offset: u64,
}

impl Dropout {
    /// Whether `p` lies in `[0, 1)` (NaN does not).
    pub fn is_valid(self) -> bool {
        (0.0..1.0).contains(&self.p)
    }

    /// The words below which a pair is dropped: `floor(p · 2³²)`, so the
    /// dropped fraction is `p` rounded down to a multiple of 2⁻³².
    pub fn threshold(self) -> u32 {
        (f64::from(self.p) * 4_294_967_296.0).floor().min(f64::from(u32::MAX)) as u32
    }

    /// What a kept pair's P is multiplied by, `1 / (1 − p)` in f32 (as the
    /// kernels take it).
    pub fn scale(self) -> f32 {
        (1.0 / (1.0 - f64::from(self.p))) as f32
    }

    /// Whether the pair (q, k) of batch row `b` and query head `h` of a
    /// launch with `heads` query heads is kept.
    pub fn keeps(self, b: usize, h: usize, heads: usize, q: usize, k: usize) -> bool {
        let bh = (b as u32).wrapping_mul(heads as u32).wrapping_add(h as u32);
        let (q, k) = (q as u32, k as u32);
        let (seed, offset) = (split(self.seed), split(self.offset));
        let words = philox4x32_10([k >> 1, q >> 1, bh, offset[0]], [seed[0], seed[1] ^ offset[1]]);
        words[(2 * (q & 1) + (k & 1)) as usize] >= self.threshold()
    }

    /// The pair's factor on P: [`Dropout::scale`] where kept, else 0.
    pub fn factor(self, b: usize, h: usize, heads: usize, q: usize, k: usize) -> f64 {
        match self.keeps(b, h, heads, q, k) {
            true => f64::from(self.scale()),
            false => 0.0,
        }
    }
}

/// `(lo32(x), hi32(x))`.
fn split(x: u64) -> [u32; 2] {
    [x as u32, (x >> 32) as u32]
}

/// Philox4x32 with 10 rounds: four random words per 128-bit `counter` under
/// a 64-bit `key`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M: [u64; 2] = [0xD251_1F53, 0xCD9E_8D57];
    const W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W[0]), k[1].wrapping_add(W[1])];
        }
        let (p0, p1) = (M[0] * u64::from(c[0]), M[1] * u64::from(c[2]));
        let (hi0, lo0, hi1, lo1) = ((p0 >> 32) as u32, p0 as u32, (p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors (`kat_vectors`, philox4x32_10).
    #[test]
    fn philox_matches_random123() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        let pi = philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]);
        assert_eq!(pi, [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]);
    }

    #[test]
    fn threshold_and_scale() {
        let d = |p| Dropout { p, seed: 0, offset: 0 };
        assert_eq!(d(0.0).threshold(), 0);
        assert_eq!(d(0.5).threshold(), 1 << 31);
        assert_eq!(d(0.25).scale(), 4.0 / 3.0);
        assert!(d(0.999_999_9).threshold() < u32::MAX);
        assert!(!d(1.0).is_valid() && !d(-0.1).is_valid() && !d(f32::NAN).is_valid() && d(0.0).is_valid());
    }

    /// p = 0 keeps every pair, at factor 1.
    #[test]
    fn zero_p_keeps_everything() {
        let d = Dropout { p: 0.0, seed: 7, offset: 9 };
        assert!((0..64).all(|q| (0..64).all(|k| d.factor(1, 2, 4, q, k) == 1.0)));
    }

    /// The kept fraction of 2²⁰ pairs is within 4σ of 1 − p for several p,
    /// and other offsets or seeds give other masks.
    #[test]
    fn kept_fraction_is_one_minus_p() {
        for p in [0.1f32, 0.5, 0.9] {
            let d = Dropout { p, seed: 0x1234_5678_9abc_def0, offset: 42 };
            let (mut kept, mut n) = (0usize, 0usize);
            for (b, h) in [(0, 0), (0, 3), (1, 1), (3, 2)] {
                for q in 0..512 {
                    for k in 0..512 {
                        kept += usize::from(d.keeps(b, h, 4, q, k));
                        n += 1;
                    }
                }
            }
            let keep = 1.0 - f64::from(p);
            let sigma = (keep * (1.0 - keep) / n as f64).sqrt();
            let fraction = kept as f64 / n as f64;
            assert!((fraction - keep).abs() < 4.0 * sigma, "p {p}: kept {fraction}, expected {keep} ± {sigma}");
        }
        let mask = |d: Dropout| (0..4096).map(|i| d.keeps(0, 0, 1, i / 64, i % 64)).collect::<Vec<_>>();
        let base = Dropout { p: 0.5, seed: 1, offset: 0 };
        assert_ne!(mask(base), mask(Dropout { offset: 1, ..base }));
        assert_ne!(mask(base), mask(Dropout { offset: 1 << 32, ..base }));
        assert_ne!(mask(base), mask(Dropout { seed: 2, ..base }));
    }
}
