//! The e4m3 checks: the forward's operands and descales
//! (`forward_e4m3::check_e4m3_operands`), its V tiles' size
//! (`forward_e4m3::VTiles::of`) and V's alignment (`check_aligned`), and an
//! e4m3 decode run's kind and descales (`check_decode::check_run_kind`).
//! Q, K and V are bytes: their layouts and lengths count bytes, as the
//! 16-bit checks count elements, so the dense draws serve as they are.

use super::dense::{assert_sound, draw, Dense};
use super::{args, need, no_panic, specs, wild, Rng, CASES};
use crate::check::{Buffer, Problem};
use crate::check_decode::{check_run_kind, RunKind};
use crate::descale::DescaleLen;
use crate::e4m3_error::E4m3Error;
use crate::error::{Error, RaggedError};
use crate::forward_e4m3::{check_aligned, check_e4m3_operands, VTiles};
use crate::layout::Layout;
use flashgen_codegen::abi::Operand;
use flashgen_codegen::cuda::{e4m3_v_row, DecodeCache, DecodeQueries, KvCacheDtype};
use flashgen_codegen::{Shape, Spec};
use std::fmt::Debug;

/// The tile widths the e4m3 kernels take (`e4m3_supports`: whole 32-key
/// steps from 96 to 256 keys).
const BLOCK_NS: [u32; 6] = [96, 128, 160, 192, 224, 256];

type Descales = [(&'static str, DescaleLen); 3];

/// A drawn e4m3 forward: a dense draw's operands (in bytes), the
/// descales and V's base address.
#[derive(Debug)]
struct E4m3 {
    d: Dense,
    descales: Descales,
    v_base: u64,
}

/// Q's, K's and V's descales, each per tensor or per K/V head, of the
/// length it reads for `heads_kv` heads (`wild`: at times off by one, 0 or
/// huge).
fn descales(rng: &mut Rng, heads_kv: usize, wild: bool) -> Descales {
    ["Q", "K", "V"].map(|operand| {
        let per_kv_head = rng.chance(50);
        let need = if per_kv_head { heads_kv } else { 1 };
        (operand, DescaleLen { per_kv_head, len: if wild { rng.count(need) } else { need } })
    })
}

/// A launch whose operands all broadcast one row (zero strides) over sizes
/// up to the checks' limits: buffers of one row hold them, so the operands'
/// checks pass whatever the batch, heads and keys.
fn broadcast(rng: &mut Rng, spec: &Spec) -> Problem {
    let (heads_kv, batch) = (rng.pick(&[1, 8, 65_535]), rng.pick(&[1, 2, 65_535]));
    let kv_len = rng.pick(&[0, 1, 1 << 20, i32::MAX as usize]);
    let one_row = |seq, heads, dim: u32| {
        let layout = Layout { batch, seq, heads, dim: dim as usize, strides: [0; 3], offset: 0 };
        Buffer { layout, len: dim as usize }
    };
    let (qk, v) = (spec.head_dims.qk, spec.head_dims.v);
    let [q, k, vv, o] = [(1, heads_kv, qk), (kv_len, heads_kv, qk), (kv_len, heads_kv, v), (1, heads_kv, v)]
        .map(|(seq, heads, dim)| one_row(seq, heads, dim));
    Problem { dtype: spec.dtype, q, k, v: vv, o, lse: None }
}

fn draw_e4m3(rng: &mut Rng, specs: &[Spec], wild: bool) -> E4m3 {
    let mut d = draw(rng, specs, wild);
    if wild && rng.odd(5) {
        d.p = broadcast(rng, &specs[d.spec]);
        d.args = args(&specs[d.spec], &d.shape(), false);
    }
    let descales = descales(rng, d.p.k.layout.heads, wild);
    // cudaMalloc's 256-byte alignment, at times a view a few bytes in.
    let skew = if wild && rng.odd(20) { rng.below(16) as u64 } else { 0 };
    let v_base = 0x7f00_0000_0000 + 256 * rng.below(1 << 20) as u64 + skew;
    E4m3 { d, descales, v_base }
}

/// What an accepted e4m3 launch must hold beyond a 16-bit forward's:
/// descales of the lengths their granularity reads, V tiles whose bytes
/// (here in i128) the scratch holds and 64-bit offsets index, and V's rows
/// 16-byte aligned exactly where `check_aligned` says so.
fn assert_e4m3_sound(e: &E4m3, spec: &Spec, shape: Shape) {
    let case: &dyn Debug = e;
    for (operand, d) in e.descales {
        let need = if d.per_kv_head { shape.heads_kv } else { 1 };
        assert_eq!(d.len, need, "{operand}'s descales: {case:?}");
    }
    let dvp = spec.head_dims.v.next_multiple_of(16) as i128;
    for block_n in BLOCK_NS {
        let tiles = (shape.kv_len as i128 + block_n as i128 - 1) / block_n as i128;
        let row = e4m3_v_row(block_n) as i128;
        let bytes = shape.batch as i128 * shape.heads_kv as i128 * tiles * dvp * row;
        match no_panic(case, || VTiles::of(spec, shape, block_n)) {
            Ok(v) => {
                assert_eq!(v.bytes as i128, bytes, "V tiles at block_n {block_n}: {case:?}");
                assert_eq!([v.tiles as i128, v.dvp as i128, v.row as i128], [tiles, dvp, row], "{case:?}");
            }
            Err(err) => {
                let refused = matches!(err, Error::TooLarge { .. }) && bytes > i64::MAX as i128;
                assert!(refused, "{err} at block_n {block_n}, {bytes} bytes: {case:?}");
            }
        }
    }
    // Each row's first byte: at index 0 and 1 of every axis of more than one.
    let v = &e.d.p.v.layout;
    let start = e.v_base as i128 + v.offset as i128;
    let sizes = [v.batch, v.seq, v.heads];
    let aligned = start % 16 == 0 && v.strides.iter().zip(sizes).all(|(&s, n)| n <= 1 || (start + s as i128) % 16 == 0);
    match no_panic(case, || check_aligned("V", e.v_base, v)) {
        Ok(()) => assert!(aligned, "accepted a V whose rows are not 16-byte aligned: {case:?}"),
        Err(err) => {
            let unaligned = matches!(err, Error::E4m3(E4m3Error::Unaligned { operand: "V" }));
            assert!(unaligned && !aligned, "{err}: {case:?}");
        }
    }
}

#[test]
fn e4m3_forward_accepts_only_launches_inside_its_buffers() {
    let specs = specs();
    let check = |e: &E4m3| check_e4m3_operands(&specs[e.d.spec], &e.d.p, &e.d.args, &e.descales);
    let sound = |e: &E4m3, launch| {
        assert_sound(&e.d, &specs[e.d.spec], false, launch);
        if let Some(shape) = launch {
            assert_e4m3_sound(e, &specs[e.d.spec], shape);
        }
    };
    wild(0xE4, 10, |rng| draw_e4m3(rng, &specs, true), check, sound);
}

#[test]
fn well_formed_e4m3_launches_pass_and_a_byte_or_a_descale_short_does_not() {
    let (specs, mut rng) = (specs(), Rng::new(0xE5));
    for _ in 0..CASES {
        let mut e = draw_e4m3(&mut rng, &specs, false);
        let spec = &specs[e.d.spec];
        let launch =
            check_e4m3_operands(spec, &e.d.p, &e.d.args, &e.descales).unwrap_or_else(|err| panic!("{err}: {e:?}"));
        let Some(shape) = launch else { continue };
        assert_e4m3_sound(&e, spec, shape);
        // One descale buffer of another length: refused, named.
        let i = rng.below(3);
        let (operand, mut d) = e.descales[i];
        d.len = rng.pick(&[d.len - 1, d.len + 1]);
        let mut descales = e.descales;
        descales[i].1 = d;
        let err = check_e4m3_operands(spec, &e.d.p, &e.d.args, &descales).unwrap_err();
        let named = matches!(err, Error::Ragged(RaggedError::DescaleLen { operand: o, .. }) if o == operand);
        assert!(named, "{err}: {e:?}");
        // One operand a byte short of its last byte.
        let p = &mut e.d.p;
        let (operand, buffer) = [(Operand::Q, &mut p.q), (Operand::K, &mut p.k), (Operand::V, &mut p.v)]
            .into_iter()
            .nth(rng.below(3))
            .unwrap();
        if buffer.layout.is_empty() {
            continue;
        }
        buffer.len = need(&buffer.layout) - 1;
        let err = check_e4m3_operands(spec, &e.d.p, &e.d.args, &e.descales).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { operand: o, .. } if o == operand), "{err}: {e:?}");
    }
}

#[test]
fn e4m3_v_tiles_of_broadcast_operands_past_64_bits_are_refused() {
    // Regression: Q, K, V and O broadcast with zero strides over 65,535
    // batches and K/V heads and MAX_LEN keys pass the operands' checks in
    // buffers of one row; the V tiles' scratch size, batch · heads_kv ·
    // tiles · 128 · 128 bytes, overflowed usize (a panic in debug builds,
    // in release a wrapped, too small allocation the V-tile kernel wrote
    // past).
    let spec = &specs()[0];
    let mut rng = Rng::new(0);
    let mut p = broadcast(&mut rng, spec);
    let [q, k, v, o] = [&mut p.q, &mut p.k, &mut p.v, &mut p.o].map(|b| &mut b.layout);
    for l in [q, k, v, o] {
        (l.batch, l.heads) = (65_535, 65_535);
    }
    (p.k.layout.seq, p.v.layout.seq) = (crate::check::MAX_LEN, crate::check::MAX_LEN);
    let descales = [("Q", 1), ("K", 1), ("V", 1)].map(|(o, len)| (o, DescaleLen { per_kv_head: false, len }));
    let shape = check_e4m3_operands(spec, &p, &[], &descales).unwrap().unwrap();
    let err = VTiles::of(spec, shape, 128).unwrap_err();
    assert!(matches!(err, Error::TooLarge { value: usize::MAX, .. }), "{err}");
}

#[test]
fn decode_runs_take_only_their_plans_kind_and_descales() {
    let mut rng = Rng::new(0xE6);
    let caches = [DecodeCache::Dense, DecodeCache::Paged];
    let queries = [DecodeQueries::Padded, DecodeQueries::Packed];
    for _ in 0..CASES {
        let rng = rng.case();
        let kv = rng.pick(&[KvCacheDtype::Spec, KvCacheDtype::E4m3]);
        let plan = RunKind { cache: rng.pick(&caches), queries: rng.pick(&queries), kv };
        let heads_kv = rng.size(8);
        let run = match rng.odd(30) {
            true => (rng.pick(&caches), rng.pick(&queries)),
            false => (plan.cache, plan.queries),
        };
        let e4m3 = if rng.odd(20) { rng.chance(50) } else { kv == KvCacheDtype::E4m3 };
        let lens = descales(rng, heads_kv, true);
        let d = e4m3.then_some(&lens[1..]);
        let case = (plan, heads_kv, run, d);
        let got = no_panic(&case, || check_run_kind(plan, heads_kv, run, d));
        let lens_ok = lens[1..].iter().all(|(_, d)| d.len == if d.per_kv_head { heads_kv } else { 1 });
        let fault = match () {
            _ if run.0 != plan.cache => Some("cache"),
            _ if run.1 != plan.queries => Some("queries"),
            _ if e4m3 != (kv == KvCacheDtype::E4m3) => Some("kv"),
            _ if e4m3 && !lens_ok => Some("descale"),
            _ => None,
        };
        let refused = match &got {
            Ok(()) => None,
            Err(Error::Ragged(RaggedError::DecodeCache { .. })) => Some("cache"),
            Err(Error::Ragged(RaggedError::DecodeQueries { .. })) => Some("queries"),
            Err(Error::Ragged(RaggedError::DecodeKvDtype { .. })) => Some("kv"),
            Err(Error::Ragged(RaggedError::DescaleLen { .. })) => Some("descale"),
            Err(err) => panic!("{err}: {case:?}"),
        };
        assert_eq!(refused, fault, "{case:?}");
    }
}

#[test]
fn per_tensor_and_per_kv_head_descales_read_one_and_heads_kv_entries() {
    for heads_kv in [1, 2, 8, 65_535] {
        for (per_kv_head, expected) in [(false, 1), (true, heads_kv)] {
            for len in [0, 1, expected - 1, expected, expected + 1, usize::MAX] {
                let d = [("K", DescaleLen { per_kv_head, len })];
                let plan =
                    RunKind { cache: DecodeCache::Dense, queries: DecodeQueries::Padded, kv: KvCacheDtype::E4m3 };
                let got = check_run_kind(plan, heads_kv, (plan.cache, plan.queries), Some(&d));
                assert_eq!(got.is_ok(), len == expected, "{heads_kv} {per_kv_head} {len}");
            }
        }
    }
}
