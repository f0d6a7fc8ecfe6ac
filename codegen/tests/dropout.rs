//! The reference forward with dropout drops exactly the pairs of
//! `codegen::dropout`'s mask (the GPU test reads the device's mask the same
//! way: Q = 0 and V the identity make O the mask), keeps the softmax's LSE,
//! and at p = 0 is the plain forward.

use flashgen_codegen::reference::{forward, forward_dropout, Precision, Problem};
use flashgen_codegen::{parse_one, Dropout, Shape};

#[test]
fn reference_output_reveals_the_mask() {
    let spec = parse_one("Reveal { dtype: bf16, head_dim: 16, mask: k <= q + 8 }").unwrap();
    let (batch, heads, q_len, d) = (2, 3, 40, 16);
    let shape = Shape { batch, heads, heads_kv: heads, q_len, kv_len: d };
    let v: Vec<f64> = (0..batch * d * heads * d).map(|i| f64::from(u8::from(i / (heads * d) % d == i % d))).collect();
    let k: Vec<f64> = (0..batch * d * heads * d).map(|i| ((i * 7919) % 13) as f64 / 13.0 - 0.5).collect();
    let problem =
        Problem { shape, q: vec![0.0; batch * q_len * heads * d], k, v, scale: 0.25, params: vec![], tensors: vec![] };
    let dropout = Dropout { p: 0.4, seed: 0xfeed_beef_0123, offset: (7 << 32) | 5 };
    let plain = forward(&spec, &problem, Precision::F64).unwrap();
    let dropped = forward_dropout(&spec, &problem, Precision::F64, dropout).unwrap();
    assert_eq!(plain.lse, dropped.lse, "dropout leaves the softmax's normalizer");
    for b in 0..batch {
        for q in 0..q_len {
            for h in 0..heads {
                for key in 0..d {
                    let at = ((b * q_len + q) * heads + h) * d + key;
                    let kept = key <= q + 8 && dropout.keeps(b, h, heads, q, key);
                    assert_eq!(dropped.o[at] != 0.0, kept, "b {b} q {q} h {h} k {key}");
                    if kept {
                        let want = plain.o[at] * f64::from(dropout.scale());
                        assert!((dropped.o[at] - want).abs() < 1e-12, "{} vs {want}", dropped.o[at]);
                    }
                }
            }
        }
    }
    let none = Dropout { p: 0.0, ..dropout };
    assert_eq!(forward_dropout(&spec, &problem, Precision::F64, none).unwrap(), plain);
}
