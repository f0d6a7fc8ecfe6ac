//! Every well-typed spec compiles: random specs (`flashgen_tools::spec_gen`)
//! parse, print back to themselves, run on the f64 reference forward and
//! backward, and compile with NVRTC for every kernel a training run uses on
//! sm_80 and sm_90a; random token streams and mutated shipped specs give the
//! parser an error with a position, never a panic.
//!
//! CI runs a few cases (NVRTC takes about a second per kernel); set
//! `FLASHGEN_RANDOM_SPECS=N` for more, `FLASHGEN_RANDOM_SEED=S` to replay.

use flashgen::codegen::reference::{self, Precision};
use flashgen::codegen::Shape;
use flashgen::runtime::{Arch, DiskCache, KernelSet};
use flashgen_tools::examples::SPECS;
use flashgen_tools::spec_gen::random_spec;
use flashgen_tools::verify::{random_d_out, random_problem};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn seed() -> u64 {
    let seed = env_or("FLASHGEN_RANDOM_SEED", std::process::id() as u64);
    println!("seed {seed} (FLASHGEN_RANDOM_SEED replays it)");
    seed
}

/// Parses a drawn spec, naming its text when it does not.
fn parse(source: &str) -> flashgen::Spec {
    flashgen::parse_one(source).unwrap_or_else(|e| panic!("a drawn spec is refused:\n{}", e.render("drawn", source)))
}

#[test]
fn random_specs_check_print_back_and_run_on_the_reference() {
    let mut rng = StdRng::seed_from_u64(seed());
    let mut sinks = 0;
    let mut previous: Option<(flashgen::Spec, String)> = None;
    for n in 0..200 {
        let drawn = random_spec(&mut rng, n);
        let spec = parse(&drawn.source);
        sinks += usize::from(spec.sink.is_some());
        let printed = flashgen::to_source(&spec);
        let reparsed = parse(&printed);
        assert_eq!(flashgen::to_source(&reparsed), printed, "printing is a fixed point:\n{}", drawn.source);
        // The runtime's in-memory identity of a spec agrees with its text.
        assert!(reparsed.same_structure(&spec), "printed and parsed back, the same spec:\n{}", drawn.source);
        if let Some((other, text)) = previous.replace((spec.clone(), printed.clone())) {
            assert_eq!(other.same_structure(&spec), text == printed, "{text}\n{printed}");
        }
        let shape = Shape { batch: 2, heads: 2, heads_kv: 1, q_len: 5, kv_len: 7 };
        let problem = random_problem(&spec, shape, drawn.params, vec![], None, n as u64);
        let out = reference::forward(&spec, &problem, Precision::F64).expect("a reference forward");
        assert!(out.o.iter().all(|x| x.is_finite()), "finite output:\n{}", drawn.source);
        // A finite sink leaves no row at -inf, fully masked ones included.
        let finite_lse = out.lse.iter().all(|x| x.is_finite());
        assert!(spec.sink.is_none() || finite_lse, "finite LSE with a sink:\n{}", drawn.source);
        reference::backward(&spec, &problem, &random_d_out(&spec, shape, n as u64)).expect("a reference backward");
    }
    assert!(sinks > 0, "no drawn spec has a sink");
}

/// Compiles `set` of `cases` drawn specs for sm_80 and sm_90a.
fn compile_drawn(cases: usize, set: KernelSet) {
    let mut rng = StdRng::seed_from_u64(seed());
    let specs: Vec<flashgen::Spec> = (0..cases).map(|n| parse(&random_spec(&mut rng, n).source)).collect();
    let dir = std::env::temp_dir().join(format!("flashgen-random-specs-{}", std::process::id()));
    let archs = [Arch::new(8, 0), Arch::new(9, 0)];
    let report = DiskCache::at(&dir).precompile(&specs, &archs, set, &|_, _| {});
    let _ = std::fs::remove_dir_all(&dir);
    let sources: Vec<String> = specs.iter().map(flashgen::to_source).collect();
    let report = report.unwrap_or_else(|e| panic!("{e}\nin one of:\n{}", sources.join("\n")));
    assert!(report.compiled >= 2 * cases, "{report:?}");
}

#[test]
fn random_specs_compile_every_training_kernel() {
    compile_drawn(env_or("FLASHGEN_RANDOM_SPECS", 2) as usize, KernelSet::Training);
}

/// Every kernel a launch may use (decode, e4m3, varlen, paged, dropout,
/// every tile configuration): about a minute per spec on two cores, so on
/// demand only (`--ignored`).
#[test]
#[ignore]
fn random_specs_compile_every_kernel() {
    compile_drawn(env_or("FLASHGEN_RANDOM_SPECS", 2) as usize, KernelSet::Every);
}

/// Random text from the language's own tokens and some that are not.
fn random_tokens(rng: &mut StdRng) -> String {
    const TOKENS: [&str; 41] = [
        "S", "{", "}", "(", ")", "[", "]", ",", ":", "dtype", "bf16", "head_dim", "64", "param", "tensor", "i32",
        "f32", "mask", "score", "sink", "q", "k", "b", "h", ">=", "&&", "||", "!", "-", "+", "*", "/", "%", "<<", "if",
        "else", "as", "1.5", "exp", "///", "\n",
    ];
    let n = rng.random_range(0..40);
    (0..n).map(|_| TOKENS[rng.random_range(0..TOKENS.len())]).collect::<Vec<_>>().join(" ")
}

/// A shipped spec with a few characters deleted, duplicated or replaced.
fn mutated_example(rng: &mut StdRng) -> String {
    let mut text: Vec<char> = SPECS[rng.random_range(0..SPECS.len())].1.chars().collect();
    for _ in 0..rng.random_range(1..4) {
        let at = rng.random_range(0..text.len());
        match rng.random_range(0..3) {
            0 => {
                text.remove(at);
            }
            1 => text.insert(at, text[at]),
            _ => {
                text[at] =
                    ['{', '}', '(', ')', ',', ':', '[', '-', '0', 'q', ' ', '"', '\u{e9}'][rng.random_range(0..13)]
            }
        }
    }
    text.into_iter().collect()
}

#[test]
fn the_parser_answers_any_text_with_a_spec_or_a_located_error() {
    let mut rng = StdRng::seed_from_u64(seed());
    for i in 0..4000 {
        let text = if i % 2 == 0 { random_tokens(&mut rng) } else { mutated_example(&mut rng) };
        if let Err(e) = flashgen::parse_str(&text) {
            let rendered = e.render("t.attn", &text);
            assert!(rendered.starts_with("t.attn:"), "an error with a position: {rendered}\nfor: {text:?}");
        }
    }
}
