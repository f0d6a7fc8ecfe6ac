use super::*;
use flashgen_codegen::{parse_one, parse_str, to_source, ExprKind};
use std::collections::HashMap;
use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

/// The shipped specs' and the language-feature spec's files.
fn spec_texts() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut paths: Vec<_> = std::fs::read_dir(root.join("specs")).unwrap().map(|e| e.unwrap().path()).collect();
    paths.sort();
    paths.push(root.join("codegen/tests/specs/language.attn"));
    paths.iter().map(|p| std::fs::read_to_string(p).unwrap()).collect()
}

fn specs() -> Vec<Spec> {
    spec_texts().iter().flat_map(|text| parse_str(text).unwrap()).collect()
}

/// `spec`'s value in `map`, looked up as launches do: by the borrowed spec.
fn find<V: Copy>(map: &HashMap<SpecKey<u8>, V>, spec: &Spec) -> Option<V> {
    map.get(&(spec, 0u8) as &dyn Keyed<u8>).copied()
}

const WINDOW: &str = "/// A window.
Window {
    dtype: bf16, head_dim: 128,
    param window: i32,
    tensor slopes: f32[H],
    mask: q >= k && q - k < window + 1,
    score: score + slopes[h] * 0.5,
}";

/// `WINDOW` with each edit's replacements (first occurrences): specs that
/// differ from it in one literal, operator, name, type, dim or doc line.
fn edited() -> Vec<Spec> {
    let edits: [&[(&str, &str)]; 14] = [
        &[("window + 1", "window + 2")],
        &[("* 0.5", "* 0.25")],
        &[("q >= k", "q > k")],
        &[("score + slopes", "score - slopes")],
        &[("param window", "param win"), ("< window", "< win")],
        &[("tensor slopes", "tensor slope"), ("slopes[h]", "slope[h]")],
        &[("f32[H]", "f16[H]")],
        &[("f32[H]", "f32[B]")],
        &[("head_dim: 128", "head_dim: 64")],
        &[("head_dim: 128", "head_dim: 128, v_head_dim: 64")],
        &[("dtype: bf16", "dtype: f16")],
        &[("/// A window.", "/// Another window.")],
        &[("Window {", "Windows {")],
        &[("Window {", "pub Window {")],
    ];
    let edit = |edit: &[(&str, &str)]| {
        edit.iter().fold(WINDOW.to_string(), |text, (from, to)| {
            assert!(text.contains(from), "{from}");
            text.replacen(from, to, 1)
        })
    };
    edits.iter().map(|e| parse_one(&edit(e)).unwrap()).collect()
}

#[test]
fn equal_specs_are_one_key() {
    for (text, spec) in spec_texts().iter().zip(specs()) {
        let map = HashMap::from([(SpecKey::new(&spec, 0u8), ())]);
        assert!(find(&map, &parse_one(text).unwrap()).is_some(), "{}: parsed twice", spec.name);
        assert!(find(&map, &parse_one(&to_source(&spec)).unwrap()).is_some(), "{}: printed, parsed", spec.name);
        assert_eq!(SpecKey::new(&spec, 0u8), SpecKey::new(&parse_one(text).unwrap(), 0u8));
    }
    let spaced = "/// A window.
        Window{dtype:bf16,head_dim:128,   // a comment
        param window : i32, tensor slopes: f32 [ H ],
        mask: (q >= k) && ((q - k) < window + 1),
        score: score + slopes[h] * 0.5 }";
    let map = HashMap::from([(SpecKey::new(&parse_one(WINDOW).unwrap(), 0u8), ())]);
    assert!(find(&map, &parse_one(spaced).unwrap()).is_some(), "whitespace, comments, parentheses");
}

#[test]
fn specs_that_differ_anywhere_are_different_keys() {
    let mut all = specs();
    all.push(parse_one(WINDOW).unwrap());
    all.extend(edited());
    // One map holds them all, many in one bucket (the edits of a literal or
    // an operator hash alike): each finds its own entry, and only its own.
    let map: HashMap<_, _> = all.iter().enumerate().map(|(i, s)| (SpecKey::new(s, 0u8), i)).collect();
    assert_eq!(map.len(), all.len());
    for (i, spec) in all.iter().enumerate() {
        assert_eq!(find(&map, spec), Some(i), "{}", to_source(spec));
        assert!(!map.contains_key(&(spec, 1u8) as &dyn Keyed<u8>), "the key's other part counts");
    }
}

/// `0.0 == -0.0`, but they print, and compile, differently.
#[test]
fn float_literals_are_keyed_by_their_bits() {
    let spec = parse_one(WINDOW).unwrap();
    let [mut negated, mut zeroed] = [spec.clone(), spec];
    for (s, value) in [(&mut negated, -0.0), (&mut zeroed, 0.0)] {
        let Some(ExprKind::Binary(_, _, scaled)) = s.score.as_mut().map(|e| &mut e.kind) else { panic!() };
        let ExprKind::Binary(_, _, half) = &mut scaled.kind else { panic!() };
        half.kind = ExprKind::Float(value);
    }
    assert_eq!(negated, zeroed);
    assert_ne!(to_source(&negated), to_source(&zeroed));
    let map = HashMap::from([(SpecKey::new(&negated, 0u8), ())]);
    assert!(find(&map, &zeroed).is_none());
}

/// The host cost of finding a launch's kernel, before (print the spec, key
/// the map by the text, as an owned `String`) and after (the borrowed spec:
/// a hash of a few fields, then one comparison): `cargo test --release -p
/// flashgen-runtime spec_key -- --ignored --nocapture`.
#[test]
#[ignore]
fn lookup_cost() {
    const RUNS: u32 = 20_000;
    let time = |f: &dyn Fn()| {
        (0..RUNS / 10).for_each(|_| f());
        let start = Instant::now();
        (0..RUNS).for_each(|_| f());
        start.elapsed().as_nanos() as f64 / f64::from(RUNS)
    };
    let all = specs();
    let by_text: HashMap<(u8, String), usize> = all.iter().enumerate().map(|(i, s)| ((0, to_source(s)), i)).collect();
    let by_spec: HashMap<SpecKey<u8>, usize> = all.iter().enumerate().map(|(i, s)| (SpecKey::new(s, 0), i)).collect();
    println!("{:<18} {:>9} {:>11} {:>11}", "spec", "to_source", "text lookup", "spec lookup");
    for spec in &all {
        let spec = parse_one(&to_source(spec)).unwrap();
        let printed = time(&|| drop(black_box(to_source(black_box(&spec)))));
        let text = time(&|| _ = black_box(by_text.get(&(0, to_source(black_box(&spec))))));
        let structural = time(&|| _ = black_box(find(&by_spec, black_box(&spec))));
        println!("{:<18} {printed:>7.0}ns {text:>9.0}ns {structural:>9.0}ns", spec.name);
    }
}
