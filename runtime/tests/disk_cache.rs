//! The disk cache without a GPU: precompiling fills it, a second precompile
//! compiles nothing, a corrupt entry is recompiled exactly once, and
//! shapes and param values never reach the cache key. A test binary of its
//! own: it sets `FLASHGEN_CACHE_DIR` and reads the process-global compile count.

use flashgen_codegen::cuda::emit_forward;
use flashgen_codegen::parse_one;
mod support;

use flashgen_runtime::{compile_count, precompile, Arch, DiskCache, EntryKey, KernelSet, CACHE_DIR_ENV};
use std::path::Path;
use support::require_nvrtc;

#[test]
fn precompile_compiles_once_and_recompiles_only_corrupt_entries() {
    require_nvrtc();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("flashgen-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::env::set_var(CACHE_DIR_ENV, &dir);
    // A mask, so the block-mask kernel is compiled with the forward (at
    // d = 64 on sm_90 two: for short keys and for long ones).
    let spec = parse_one("Causal { dtype: bf16, head_dim: 64, mask: q >= k }").unwrap();
    let sm90 = [Arch::new(9, 0)];

    let before = compile_count();
    let first = precompile(std::slice::from_ref(&spec), &sm90, KernelSet::Inference).unwrap();
    assert_eq!((first.kernels, first.compiled, first.cached), (3, 3, 0));
    assert_eq!(compile_count() - before, 3);
    let entries = DiskCache::at(&dir).entries().unwrap();
    assert_eq!(entries.len(), 3);

    let before = compile_count();
    let second = precompile(std::slice::from_ref(&spec), &sm90, KernelSet::Inference).unwrap();
    assert_eq!((second.compiled, second.cached), (0, 3));
    assert_eq!(compile_count(), before, "a warm cache compiles nothing");

    let mut bytes = std::fs::read(&entries[0].path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&entries[0].path, bytes).unwrap();
    let before = compile_count();
    let third = precompile(std::slice::from_ref(&spec), &sm90, KernelSet::Inference).unwrap();
    assert_eq!((third.compiled, third.cached), (1, 2));
    assert_eq!(compile_count() - before, 1, "only the corrupt entry is recompiled");
    assert_eq!(DiskCache::at(&dir).entries().unwrap().len(), 3);

    // Training adds the four backward kernels; the three others are cached.
    let before = compile_count();
    let training = precompile(std::slice::from_ref(&spec), &sm90, KernelSet::Training).unwrap();
    assert_eq!((training.kernels, training.compiled, training.cached), (7, 4, 3));
    assert_eq!(compile_count() - before, 4);

    assert_eq!(DiskCache::at(&dir).clear().unwrap().kernels, 7);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn shapes_and_param_values_never_change_the_key() {
    require_nvrtc();
    let text = "Softcap { dtype: f16, head_dim: 128, param cap: f32, score: cap * tanh(score / cap) }";
    let spec = parse_one(text).unwrap();
    // Shapes, strides and param values are not inputs of the emitter at all:
    // emitting the same spec (parsed twice) gives the same source and key.
    let (a, b) = (emit_forward(&spec), emit_forward(&parse_one(text).unwrap()));
    assert_eq!(a.source, b.source);
    let sm90 = Arch::new(9, 0);
    assert_eq!(EntryKey::new(&a, sm90).unwrap(), EntryKey::new(&b, sm90).unwrap());
    assert_ne!(EntryKey::new(&a, sm90).unwrap(), EntryKey::new(&a, Arch::new(8, 0)).unwrap());
    let other = emit_forward(&parse_one(&text.replace("128", "64")).unwrap());
    assert_ne!(EntryKey::new(&a, sm90).unwrap(), EntryKey::new(&other, sm90).unwrap());
}
