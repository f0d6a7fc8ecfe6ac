//! What the GPU test files share: the runtime, the example specs and test
//! values for their params.

use flashgen::codegen::reference::ParamValue;
use flashgen::codegen::{Dtype, HeadDims, Spec};
use flashgen::Runtime;
use flashgen_tools::examples::SPECS;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

#[allow(dead_code)] // the forward tests judge no gradients
pub mod backward;
#[allow(dead_code)] // only the decode tests run decode cases
pub mod decode;
#[allow(dead_code)] // the backward tests launch no forward cases of their own
pub mod forward;
#[allow(dead_code)] // the dense tests pack no sequences
pub mod packed;

/// The first GPU. The GPU tests are `#[ignore]`d, so they run only when
/// asked for (`--include-ignored`): a missing GPU then fails them rather than
/// passing them unrun.
pub fn runtime() -> Runtime {
    Runtime::new(0).unwrap_or_else(|e| panic!("a GPU test needs a working NVIDIA GPU: {e}"))
}

/// The example spec `specs/<variant>.attn`.
pub fn spec(variant: &str) -> Spec {
    let (_, source) = SPECS.iter().find(|(name, _)| *name == variant).expect("a known variant");
    flashgen::parse_one(source).unwrap_or_else(|e| panic!("{}", e.render(variant, source)))
}

/// The fixture of the language's later additions (bit operators, Euclidean
/// builtins, dimension expressions), `codegen/tests/specs/language.attn`.
#[allow(dead_code)] // the autotuning tests read none
pub fn language_spec() -> Spec {
    let source = include_str!("../../../codegen/tests/specs/language.attn");
    flashgen::parse_one(source).unwrap_or_else(|e| panic!("{}", e.render("language.attn", source)))
}

/// A table row's leading columns: the spec's name, dtype and head dims.
#[allow(dead_code)] // the tests that print no table
pub fn spec_columns(spec: &Spec) -> String {
    format!("{:<18} {:<4} d={:>3}/{:<3}", spec.name, spec.dtype.name(), spec.head_dims.qk, spec.head_dims.v)
}

/// Test values for the params of the example specs and fixtures.
pub fn params(spec: &Spec) -> Vec<ParamValue> {
    spec.params
        .iter()
        .map(|p| match p.name.as_str() {
            "window" => ParamValue::I32(96),
            "prefix" => ParamValue::I32(70),
            // Global tokens and sinks that end inside a tile.
            "globals" => ParamValue::I32(40),
            "sinks" => ParamValue::I32(20),
            "cap" => ParamValue::F32(30.0),
            "shift" => ParamValue::I32(6),
            other => panic!("no test value for param `{other}`"),
        })
        .collect()
}

/// `spec` at another dtype and head dims.
#[allow(dead_code)] // the context-parallel tests keep the specs' dtypes
pub fn with(mut spec: Spec, dtype: Dtype, qk: u32, v: u32) -> Spec {
    spec.dtype = dtype;
    spec.head_dims = HeadDims { qk, v };
    spec
}

/// Query and K/V heads for an example spec's GPU cases (GQA's own ratio).
#[allow(dead_code)] // the packed-sequence tests' share
pub fn heads_of(variant: &str) -> (usize, usize) {
    if variant == "gqa" {
        (8, 2)
    } else {
        (4, 2)
    }
}

/// Ragged (queries, keys) per sequence: `fixed` ones and `draws` more with
/// odd query counts below `2 · odd_below`, keys from `keys(q, rng)`;
/// shuffled.
#[allow(dead_code)] // the packed-sequence tests' share
pub fn ragged(
    rng: &mut StdRng,
    fixed: &[(usize, usize)],
    (draws, odd_below): (usize, usize),
    keys: impl Fn(usize, &mut StdRng) -> usize,
) -> Vec<(usize, usize)> {
    let mut lens = fixed.to_vec();
    for _ in 0..draws {
        let q = 2 * rng.random_range(0..odd_below) + 1;
        lens.push((q, keys(q, rng)));
    }
    lens.shuffle(rng);
    lens
}
