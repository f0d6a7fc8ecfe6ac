//! The runtime's launch contract on a real GPU: strided layouts, GQA head
//! mapping, params, captured tensors, scale, LSE, the kernel cache, callers'
//! streams and typed errors with real buffers. Ignored by a plain `cargo
//! test`: they need a GPU; run them with `--include-ignored`, where a
//! missing GPU fails them.
//! Accuracy against the CPU reference is tested by flashgen-tools' GPU tests;
//! here every row keeps exactly one key, so its softmax weight is exactly 1
//! and O must equal a V row bit for bit.

use flashgen_codegen::{parse_one, Spec};
use flashgen_runtime::cudarc::driver::CudaSlice;
use flashgen_runtime::half::{bf16, f16};
use flashgen_runtime::tile_choice;
use flashgen_runtime::{
    ArgValue, DeviceInput, DeviceOutput, Element, Error, ForwardIo, ForwardOptions, Layout, Runtime,
};
use std::fmt::Debug;
use std::sync::Arc;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The first GPU; without one the (ignored unless asked for) test fails.
fn runtime() -> Runtime {
    Runtime::new(0).unwrap_or_else(|e| panic!("a GPU test needs a working NVIDIA GPU: {e}"))
}

trait TestElem: Element + PartialEq + Debug {
    fn from_f32(x: f32) -> Self;
    fn is_nan(self) -> bool;
}

impl TestElem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn is_nan(self) -> bool {
        f16::is_nan(self)
    }
}

impl TestElem for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn is_nan(self) -> bool {
        bf16::is_nan(self)
    }
}

/// Operand contents: small multiples of 1/4, exact in f16 and bf16.
fn value(seed: usize, l: &Layout, (b, s, h, d): (usize, usize, usize, usize)) -> f32 {
    let i = seed + ((b * l.seq + s) * l.heads + h) * l.dim + d;
    ((i * 7919) % 13) as f32 * 0.25 - 1.5
}

/// Element offset of (b, s, h, d) in `l`.
fn offset(l: &Layout, (b, s, h, d): (usize, usize, usize, usize)) -> usize {
    (b as i64 * l.strides[0] + s as i64 * l.strides[1] + h as i64 * l.strides[2]) as usize + d
}

/// The buffer length that exactly covers `l`.
fn span(l: &Layout) -> usize {
    offset(l, (l.batch - 1, l.seq - 1, l.heads - 1, l.dim - 1)) + 1
}

fn indices(l: &Layout) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    let (nb, ns, nh, nd) = (l.batch, l.seq, l.heads, l.dim);
    (0..nb).flat_map(move |b| (0..ns).flat_map(move |s| (0..nh).flat_map(move |h| (0..nd).map(move |d| (b, s, h, d)))))
}

/// A host buffer for `l`: NaN padding, `value(seed, ..)` where addressed.
fn fill<T: TestElem>(l: &Layout, seed: usize) -> Vec<T> {
    let mut host = vec![T::from_f32(f32::NAN); span(l)];
    for at in indices(l) {
        host[offset(l, at)] = T::from_f32(value(seed, l, at));
    }
    host
}

/// One launch whose row (b, s) keeps only key `key(b, s)`, with score
/// `scale · q·k + bias`.
struct OneKey<'a, F> {
    spec: &'a Spec,
    /// Q, K, V, O.
    layouts: [Layout; 4],
    args: &'a [ArgValue<'a>],
    scale: f32,
    bias: f32,
    key: F,
}

impl<F: Fn(usize, usize) -> usize> OneKey<'_, F> {
    /// Launches and checks O bit for bit, O's padding untouched, and the LSE.
    fn check<T: TestElem>(&self, rt: &Runtime) -> TestResult {
        let [ql, kl, vl, ol] = self.layouts;
        let stream = rt.stream();
        let (q, k) = (stream.clone_htod(&fill::<T>(&ql, 0))?, stream.clone_htod(&fill::<T>(&kl, 1))?);
        let v_host = fill::<T>(&vl, 2);
        let v = stream.clone_htod(&v_host)?;
        let mut o: CudaSlice<T> = stream.clone_htod(&vec![T::from_f32(f32::NAN); span(&ol)])?;
        let mut lse = stream.clone_htod(&vec![f32::NAN; ql.batch * ql.heads * ql.seq])?;
        let io = ForwardIo { q: (&q, ql), k: (&k, kl), v: (&v, vl), o: (&mut o, ol), lse: Some(&mut lse) };
        rt.forward(self.spec, io, self.args, &ForwardOptions { scale: Some(self.scale), ..Default::default() })?;
        let (o_host, lse_host) = (stream.clone_dtoh(&o)?, stream.clone_dtoh(&lse)?);

        let group = ql.heads / kl.heads;
        let mut written = vec![false; o_host.len()];
        for (b, s, h, d) in indices(&ol) {
            let (at, kv) = (offset(&ol, (b, s, h, d)), (self.key)(b, s));
            written[at] = true;
            assert_eq!(o_host[at], v_host[offset(&vl, (b, kv, h / group, d))], "O[{b}, {s}, {h}, {d}]");
        }
        for (at, x) in o_host.iter().enumerate() {
            assert!(written[at] || x.is_nan(), "padding element {at} of O was written");
        }
        for (b, s, h) in indices(&Layout { dim: 1, ..ql }).map(|(b, s, h, _)| (b, s, h)) {
            let kv = (self.key)(b, s);
            let dot: f64 = (0..ql.dim)
                .map(|d| f64::from(value(0, &ql, (b, s, h, d)) * value(1, &kl, (b, kv, h / group, d))))
                .sum();
            let expected = f64::from(self.scale) * dot + f64::from(self.bias);
            let got = f64::from(lse_host[(b * ql.heads + h) * ql.seq + s]);
            assert!(
                (got - expected).abs() <= 1e-4 * expected.abs().max(1.0),
                "LSE[{b}, {h}, {s}] = {got}, expected {expected}"
            );
        }
        Ok(())
    }
}

/// BHSD Q, BSHD K, V with padded heads and batches, O padded between heads.
fn strided(
    batch: usize,
    q_len: usize,
    kv_len: usize,
    heads: usize,
    heads_kv: usize,
    dqk: usize,
    dv: usize,
) -> [Layout; 4] {
    let padded = |seq: usize, heads: usize, dim: usize| {
        let head = (dim + 8) as i64;
        Layout {
            batch,
            seq,
            heads,
            dim,
            strides: [seq as i64 * heads as i64 * head + 24, heads as i64 * head, head],
            offset: 0,
        }
    };
    [
        Layout::bhsd(batch, q_len, heads, dqk),
        Layout::bshd(batch, kv_len, heads_kv, dqk),
        padded(kv_len, heads_kv, dv),
        padded(q_len, heads, dv),
    ]
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn single_key_copies_v_through_strided_gqa_layouts() -> TestResult {
    let rt = runtime();
    let spec = parse_one("Gqa { dtype: bf16, head_dim: 64, v_head_dim: 32 }")?;
    let run = OneKey {
        spec: &spec,
        layouts: strided(3, 70, 1, 4, 2, 64, 32),
        args: &[],
        scale: 0.125,
        bias: 0.0,
        key: |_, _| 0,
    };
    run.check::<bf16>(&rt)?;
    // Served from the cache from now on.
    assert!(Arc::ptr_eq(&rt.load(&spec)?, &rt.load(&spec)?));
    Ok(())
}

/// A runtime on the caller's stream queues there, in order with the
/// caller's copies; a runtime on another stream of the device shares the
/// loaded kernels (no second compile or disk read) and launches its
/// persistent kernels with a work counter of its own.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn callers_streams_share_the_kernels() -> TestResult {
    let ctx = flashgen_runtime::cudarc::driver::CudaContext::new(0)?;
    let caller = ctx.new_stream()?;
    let rt = Runtime::from_stream(caller.clone())?;
    assert!(Arc::ptr_eq(rt.stream(), &caller));
    let spec = parse_one("Streams { dtype: bf16, head_dim: 64 }")?;
    let run = OneKey {
        spec: &spec,
        layouts: strided(2, 300, 1, 4, 2, 64, 64),
        args: &[],
        scale: 0.25,
        bias: 0.0,
        key: |_, _| 0,
    };
    run.check::<bf16>(&rt)?;
    let before = rt.cache_stats();
    let other = rt.on_stream(ctx.new_stream()?)?;
    run.check::<bf16>(&other)?;
    run.check::<bf16>(&rt)?;
    let after = other.cache_stats();
    assert_eq!((after.compiles, after.disk_hits), (before.compiles, before.disk_hits));
    assert!(after.memory_hits > before.memory_hits);
    Ok(())
}

/// `spec`'s forward, without params, from Q, K and V into `o` (each its
/// memory and layout).
fn forward<'a, T: Element>(
    rt: &Runtime,
    spec: &Spec,
    [q, k, v]: [(&'a dyn DeviceInput<T>, Layout); 3],
    o: (&'a mut dyn DeviceOutput<T>, Layout),
) -> Result<(), Error> {
    rt.forward(spec, ForwardIo { q, k, v, o, lse: None }, &[], &ForwardOptions::default())
}

/// Q, K and V as views into one fused projection's output (offsets into the
/// buffer, its row stride) run without a copy and give, bit for bit, the O
/// of the same values in buffers of their own.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn fused_qkv_views_match_separate_buffers() -> TestResult {
    let rt = runtime();
    let spec = parse_one("Fused { dtype: bf16, head_dim: 64, mask: q >= k }")?;
    let (batch, seq, heads, heads_kv, dim) = (2, 200, 4, 2, 64);
    let views = Layout::fused_qkv(batch, seq, heads, heads_kv, dim);
    let len = batch * seq * (heads + 2 * heads_kv) * dim;
    let host: Vec<bf16> = (0..len).map(|i| bf16::from_f32(((i * 7919) % 13) as f32 * 0.25 - 1.5)).collect();
    let stream = rt.stream();
    let fused = stream.clone_htod(&host)?;
    let own = views.map(|l| Layout::bshd(l.batch, l.seq, l.heads, l.dim));
    let gathered: Vec<CudaSlice<bf16>> = views
        .iter()
        .zip(&own)
        .map(|(view, l)| {
            stream.clone_htod(&indices(l).map(|at| host[view.offset + offset(view, at)]).collect::<Vec<_>>())
        })
        .collect::<Result<_, _>>()?;
    let ol = Layout::bshd(batch, seq, heads, dim);
    let mut outputs = Vec::new();
    for (q, k, v, [ql, kl, vl]) in [(&fused, &fused, &fused, views), (&gathered[0], &gathered[1], &gathered[2], own)] {
        let mut o = stream.alloc_zeros::<bf16>(ol.len())?;
        forward(&rt, &spec, [(q, ql), (k, kl), (v, vl)], (&mut o, ol))?;
        outputs.push(stream.clone_dtoh(&o)?);
    }
    assert!(outputs[0] == outputs[1], "O from the fused views differs from O from separate buffers");
    // A view that reaches past the buffer is refused.
    let past = views[2].at(views[2].offset + dim);
    let mut o = stream.alloc_zeros::<bf16>(ol.len())?;
    let err = forward(&rt, &spec, [(&fused, views[0]), (&fused, views[1]), (&fused, past)], (&mut o, ol)).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    Ok(())
}

/// Operands may be views of larger buffers (`CudaView`, `CudaViewMut`): O
/// written through a view equals O from whole buffers, and the view's
/// neighbours stay untouched.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn cuda_views_are_operands() -> TestResult {
    let rt = runtime();
    let spec = parse_one("Views { dtype: f16, head_dim: 64, mask: q >= k }")?;
    let l = Layout::bshd(2, 150, 2, 64);
    let stream = rt.stream();
    let host = fill::<f16>(&l, 3);
    let whole = stream.clone_htod(&host)?;
    let mut padded_host = vec![f16::from_f32(f32::NAN); 40];
    padded_host.extend(&host);
    padded_host.extend(vec![f16::from_f32(f32::NAN); 24]);
    let padded = stream.clone_htod(&padded_host)?;
    let view = padded.slice(40..40 + l.len());
    let mut o_whole = stream.alloc_zeros::<f16>(l.len())?;
    forward(&rt, &spec, [(&whole, l); 3], (&mut o_whole, l))?;
    let mut o_padded = stream.clone_htod(&vec![f16::from_f32(f32::NAN); l.len() + 64])?;
    {
        let mut o_view = o_padded.slice_mut(32..32 + l.len());
        forward(&rt, &spec, [(&view, l); 3], (&mut o_view, l))?;
    }
    let (expected, got) = (stream.clone_dtoh(&o_whole)?, stream.clone_dtoh(&o_padded)?);
    assert!(got[32..32 + l.len()] == expected[..], "O through views differs");
    assert!(got[..32].iter().chain(&got[32 + l.len()..]).all(|x| x.is_nan()), "a view's neighbour was written");
    Ok(())
}

/// Kernels loaded in parallel come back in their configs' order, and are
/// the ones the cache then serves one at a time.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn parallel_loads_are_in_config_order() -> TestResult {
    let rt = runtime();
    let spec = parse_one("Parallel { dtype: f16, head_dim: 64 }")?;
    let configs = tile_choice::candidates(&spec, rt.target());
    for (&config, loaded) in configs.iter().zip(rt.load_forwards(&spec, &configs)) {
        assert!(Arc::ptr_eq(&loaded?, &rt.load_forward(&spec, config)?));
    }
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn params_and_tensors_reach_the_kernel() -> TestResult {
    let rt = runtime();
    let spec = parse_one(
        "Pick { dtype: f16, head_dim: 16, param offset: i32, param bias: f32, tensor pick: i32[B], \
         mask: k == pick[b] + offset, score: score + bias }",
    )?;
    let pick = rt.stream().clone_htod(&[1i32, 3])?;
    let args = [ArgValue::from(1), ArgValue::from(0.75f32), ArgValue::from(&pick)];
    let run = OneKey {
        spec: &spec,
        layouts: strided(2, 65, 5, 3, 3, 16, 16),
        args: &args,
        scale: 0.5,
        bias: 0.75,
        key: |b, _| [2, 4][b],
    };
    run.check::<f16>(&rt)
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_launches_are_typed_errors() -> TestResult {
    let rt = runtime();
    let spec = parse_one("Full { dtype: bf16, head_dim: 64 }")?;
    let l = Layout::bshd(2, 16, 2, 64);
    let stream = rt.stream();

    let half16 = stream.alloc_zeros::<f16>(l.len())?;
    let mut o16 = stream.alloc_zeros::<f16>(l.len())?;
    let io = ForwardIo { q: (&half16, l), k: (&half16, l), v: (&half16, l), o: (&mut o16, l), lse: None };
    let err = rt.forward(&spec, io, &[], &ForwardOptions::default()).unwrap_err();
    assert!(matches!(err, Error::Dtype { .. }), "{err}");

    let x = stream.alloc_zeros::<bf16>(l.len())?;
    let mut short = stream.alloc_zeros::<bf16>(l.len() - 1)?;
    let io = ForwardIo { q: (&x, l), k: (&x, l), v: (&x, l), o: (&mut short, l), lse: None };
    let err = rt.forward(&spec, io, &[], &ForwardOptions::default()).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");

    let scalar = 1i32;
    let io = ForwardIo { q: (&x, l), k: (&x, l), v: (&x, l), o: (&mut short, l), lse: None };
    let err = rt.forward(&spec, io, &[ArgValue::from(scalar)], &ForwardOptions::default()).unwrap_err();
    assert!(matches!(err, Error::ArgCount { expected: 0, got: 1, .. }), "{err}");

    // An empty output launches nothing and succeeds.
    let empty = Layout::bshd(2, 0, 2, 64);
    let mut none = stream.alloc_zeros::<bf16>(1)?;
    let io = ForwardIo { q: (&x, empty), k: (&x, l), v: (&x, l), o: (&mut none, empty), lse: None };
    rt.forward(&spec, io, &[], &ForwardOptions::default())?;
    stream.synchronize()?;
    Ok(())
}
