//! Marshalling against each kernel family's argument list: values, inline
//! buffers and grids.

use super::*;
use flashgen_codegen::abi::KernelArg;
use flashgen_codegen::ElemTy;

fn kernel(kinds: &[ArgKind]) -> Kernel {
    Kernel {
        name: "k".into(),
        source: String::new(),
        grid: Grid::QueryTiles,
        block_m: 64,
        block_n: 32,
        threads: 128,
        dynamic_smem: 1024,
        args: kinds.iter().enumerate().map(|(i, &kind)| KernelArg { name: format!("a{i}"), kind }).collect(),
    }
}

const SHAPE: Shape = Shape { batch: 3, heads: 8, heads_kv: 2, q_len: 129, kv_len: 7 };

fn bindings<'a>(args: &'a [ArgInfo], tensors: &'a [u64]) -> Bindings<'a> {
    Bindings {
        ptrs: [10, 11, 12, 13],
        strides: [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]],
        scale: 0.125,
        block_mask: (77, [40, 0]),
        block_mask_out: 78,
        work_order: 79,
        ..Bindings::without_operands(SHAPE, args, tensors)
    }
}

#[test]
fn values_follow_the_abi_order() {
    let k = kernel(&[
        ArgKind::Ptr(Operand::V),
        ArgKind::Lse,
        ArgKind::Stride(Operand::K, Axis::Head),
        ArgKind::QLen,
        ArgKind::HeadsKv,
        ArgKind::Scale,
        ArgKind::Param(1),
        ArgKind::Param(0),
        ArgKind::Tensor(0),
        ArgKind::BlockMask,
        ArgKind::BlockMaskStride(Axis::Batch),
        ArgKind::BlockMaskStride(Axis::Head),
        ArgKind::BlockMaskOut,
    ]);
    let args = [ArgInfo::I32(-5), ArgInfo::F32(2.5), ArgInfo::Tensor(ElemTy::F32, 8)];
    let values = marshal(&k, &bindings(&args, &[99])).unwrap();
    use Value::*;
    let expected = [
        Ptr(12),
        Ptr(0),
        I64(6),
        I32(129),
        I32(2),
        F32(0.125),
        F32(2.5),
        I32(-5),
        Ptr(99),
        Ptr(77),
        I64(40),
        I64(0),
        Ptr(78),
    ];
    assert_eq!(values, expected);
}

/// The operands a varlen or paged forward copying with TMA takes
/// descriptors of.
const FORWARD_MAPS: [Operand; 4] = [Operand::Q, Operand::K, Operand::V, Operand::O];

/// A varlen kernel's sequences, longest lengths and token counts come
/// from the varlen bindings and the shape, its strides from each
/// operand's token and head axes; without varlen bindings it is refused.
#[test]
fn varlen_kernels_marshal_their_sequences() {
    use flashgen_codegen::cuda::{emit_forward_varlen, Mma, TileConfig, TileCopy};
    let spec = flashgen_codegen::parse_one(
        "D { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
    )
    .unwrap();
    let args = [ArgInfo::Tensor(ElemTy::I32, 3 * 7)];
    let persistent = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 128 };
    for config in [TileConfig::default_for(&spec), persistent] {
        let kernel = emit_forward_varlen(&spec, config, TileCopy::Tma);
        let varlen = Some(VarlenBindings { cu_seqlens: [91, 92], tokens: [500, 700] });
        let tensor_maps = Some(FORWARD_MAPS.map(|op| (op, crate::tma::TensorMap::ZERO)).into_iter().collect());
        let b = Bindings { varlen, tensor_maps, work_counter: Some(93), ..bindings(&args, &[99]) };
        let values = marshal(&kernel, &b).unwrap();
        let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
        use Value::*;
        for (name, expected) in [
            ("cu_seqlens_q", Ptr(91)),
            ("cu_seqlens_k", Ptr(92)),
            ("max_q_len", I32(129)),
            ("max_kv_len", I32(7)),
            ("total_q", I32(500)),
            ("total_kv", I32(700)),
            ("q_seq_stride", I64(2)),
            ("v_head_stride", I64(9)),
            ("t_doc", Ptr(99)),
        ] {
            assert_eq!(value(name), expected, "{name} in {config:?}");
        }
        let err = marshal(&kernel, &Bindings { varlen: None, ..b }).unwrap_err();
        assert!(matches!(err, Error::KernelAbi { .. }), "{err}");
    }
}

/// A paged kernel's caches: pages' strides from their layouts' batch
/// axis, the table, lengths and sizes from the paged bindings (and a
/// warp-specialized kernel's TMA boxes); without them it is refused.
#[test]
fn paged_kernels_marshal_their_caches() {
    use flashgen_codegen::cuda::{emit_forward_paged, Mma, TileConfig, TileCopy};
    let spec = flashgen_codegen::parse_one("C { dtype: bf16, head_dim: 64, mask: q + kv_len - q_len >= k }").unwrap();
    let persistent = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 128 };
    for config in [TileConfig::default_for(&spec), persistent] {
        let kernel = emit_forward_paged(&spec, config, TileCopy::Tma);
        let varlen = Some(VarlenBindings { cu_seqlens: [0, 0], tokens: [500, 0] });
        let paged = Some(PagedBindings { kv_lens: 94, block_table: 95, pages_per_seq: 6, page_size: 3, num_pages: 17 });
        let tensor_maps = Some(FORWARD_MAPS.map(|op| (op, crate::tma::TensorMap::ZERO)).into_iter().collect());
        let b = Bindings { varlen, paged, tensor_maps, kv_box_rows: 8, work_counter: Some(93), ..bindings(&[], &[]) };
        let values = marshal(&kernel, &b).unwrap();
        let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
        use Value::*;
        for (name, expected) in [
            ("cu_seqlens_q", Ptr(0)),
            ("kv_lens", Ptr(94)),
            ("block_table", Ptr(95)),
            ("pages_per_seq", I32(6)),
            ("page_size", I32(3)),
            ("num_pages", I32(17)),
            ("max_kv_len", I32(7)),
            ("k_page_stride", I64(4)),
            ("k_seq_stride", I64(5)),
            ("v_page_stride", I64(7)),
            ("v_head_stride", I64(9)),
        ] {
            assert_eq!(value(name), expected, "{name} in {config:?}");
        }
        if config == persistent {
            assert_eq!(value("kv_box_rows"), I32(8));
        }
        let err = marshal(&kernel, &Bindings { paged: None, ..b }).unwrap_err();
        assert!(matches!(err, Error::KernelAbi { .. }), "{err}");
    }
}

/// A decode kernel's lengths, split count and workspace come from the
/// decode bindings, the cache's rows from the shape; inline marshalling
/// gives the same values as `marshal`; the grid covers every row tile
/// of every split.
#[test]
fn decode_kernels_marshal_their_lengths_and_splits() {
    use flashgen_codegen::cuda::{emit_decode, DecodeConfig, Target};
    let spec = flashgen_codegen::parse_one(
        "D { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
    )
    .unwrap();
    let kernel = emit_decode(&spec, DecodeConfig::for_rows(&spec, Target::HOPPER, 8).unwrap());
    let args = [ArgInfo::Tensor(ElemTy::I32, 3 * 7)];
    let decode = Some(DecodeBindings { kv_lens: 94, splits: 5, partial: [95, 96], counters: 98 });
    let b = Bindings { decode, ..bindings(&args, &[99]) };
    let values = marshal(&kernel, &b).unwrap();
    let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
    use Value::*;
    for (name, expected) in [
        ("kv_lens", Ptr(94)),
        ("num_splits", I32(5)),
        ("partial_o", Ptr(95)),
        ("partial_lse", Ptr(96)),
        ("split_counters", Ptr(98)),
        ("max_kv_len", I32(7)),
        ("max_q_len", I32(129)),
        ("k_seq_stride", I64(5)),
        ("t_doc", Ptr(99)),
    ] {
        assert_eq!(value(name), expected, "{name}");
    }
    let mut inline = [Value::I32(0); INLINE_ARGS];
    let count = marshal_into(&kernel, &b, &mut inline).unwrap();
    assert_eq!(&inline[..count], &values[..]);
    assert!(matches!(marshal_into(&kernel, &b, &mut inline[..3]), Err(Error::KernelAbi { .. })));
    assert!(matches!(marshal(&kernel, &Bindings { decode: None, ..b }), Err(Error::KernelAbi { .. })));
    // 8 heads over 2 K/V heads x 129 queries = 516 rows: 33 tiles of 16, 5 splits each.
    let grid = launch_config(&kernel, &SHAPE, 5, 132).unwrap();
    assert_eq!(grid.grid_dim, (33 * 5, 2, 3));
}

/// A paged decode kernel binds its block table and sizes from the paged
/// bindings and K's and V's pages' strides from their layouts' batch
/// axis, beside the decode bindings; without the paged ones it is refused.
#[test]
fn paged_decode_kernels_marshal_their_tables() {
    use flashgen_codegen::cuda::{emit_decode_paged, DecodeConfig, Target};
    let spec = flashgen_codegen::parse_one("D { dtype: bf16, head_dim: 64 }").unwrap();
    let kernel = emit_decode_paged(&spec, DecodeConfig::for_rows(&spec, Target::HOPPER, 8).unwrap());
    let decode = Some(DecodeBindings { kv_lens: 94, splits: 5, partial: [95, 96], counters: 98 });
    let paged = Some(PagedBindings { kv_lens: 94, block_table: 97, pages_per_seq: 6, page_size: 16, num_pages: 40 });
    let b = Bindings { decode, paged, ..bindings(&[], &[]) };
    let values = marshal(&kernel, &b).unwrap();
    let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
    use Value::*;
    for (name, expected) in [
        ("kv_lens", Ptr(94)),
        ("block_table", Ptr(97)),
        ("pages_per_seq", I32(6)),
        ("page_size", I32(16)),
        ("num_pages", I32(40)),
        ("k_page_stride", I64(4)),
        ("k_seq_stride", I64(5)),
        ("v_page_stride", I64(7)),
        ("v_head_stride", I64(9)),
        ("q_batch_stride", I64(1)),
        ("num_splits", I32(5)),
    ] {
        assert_eq!(value(name), expected, "{name}");
    }
    assert!(!kernel.args.iter().any(|a| a.name == "k_batch_stride"), "pages replace K's batch axis");
    let mut inline = [Value::I32(0); INLINE_ARGS];
    let count = marshal_into(&kernel, &b, &mut inline).unwrap();
    assert_eq!(&inline[..count], &values[..]);
    assert!(matches!(marshal(&kernel, &Bindings { paged: None, ..b }), Err(Error::KernelAbi { .. })));
}

/// An e4m3 decode kernel binds its byte caches from K's and V's pointers
/// and each one's descales from the bindings' K and V slots; without them
/// it is refused.
#[test]
fn e4m3_decode_kernels_marshal_their_descales() {
    use flashgen_codegen::cuda::{emit_decode_paged, DecodeConfig, KvCacheDtype, Target};
    let spec = flashgen_codegen::parse_one("D { dtype: bf16, head_dim: 64 }").unwrap();
    let config = DecodeConfig::for_cache(&spec, Target::HOPPER, 8, KvCacheDtype::E4m3).unwrap();
    let kernel = emit_decode_paged(&spec, config);
    let descales = Some([(80, 1), (81, 1), (82, 0)]);
    let decode = DecodeBindings { kv_lens: 94, splits: 5, partial: [95, 96], counters: 98 };
    let paged = Some(PagedBindings { kv_lens: 94, block_table: 97, pages_per_seq: 6, page_size: 16, num_pages: 40 });
    let b = Bindings { decode: Some(decode), paged, descales, ..bindings(&[], &[]) };
    let values = marshal(&kernel, &b).unwrap();
    let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
    use Value::*;
    for (name, expected) in [
        ("k_ptr", Ptr(b.ptrs[1])),
        ("v_ptr", Ptr(b.ptrs[2])),
        ("k_descale", Ptr(81)),
        ("k_descale_stride", I32(1)),
        ("v_descale", Ptr(82)),
        ("v_descale_stride", I32(0)),
        ("k_page_stride", I64(4)),
    ] {
        assert_eq!(value(name), expected, "{name}");
    }
    assert!(matches!(marshal(&kernel, &Bindings { descales: None, ..b }), Err(Error::KernelAbi { .. })));
}

/// The e4m3 forward binds Q's, K's and V's bytes from their pointers and
/// each one's descales from the bindings' slots, its V-tile kernel the
/// tiles it writes; without them they are refused.
#[test]
fn e4m3_forward_kernels_marshal_their_operands() {
    use flashgen_codegen::cuda::{emit_e4m3_v_tiles, emit_forward_e4m3, Mma, TileConfig};
    let spec = flashgen_codegen::parse_one("S { dtype: bf16, head_dim: 128, mask: q >= k }").unwrap();
    let config = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 224 };
    let kernel = emit_forward_e4m3(&spec, config).unwrap();
    let maps = Some(
        [Operand::Q, Operand::K, Operand::V, Operand::O]
            .map(|op| (op, crate::tma::TensorMap::ZERO))
            .into_iter()
            .collect(),
    );
    let descales = Some([(80, 1), (81, 0), (82, 1)]);
    let b = Bindings { descales, tensor_maps: maps, work_counter: Some(99), ..bindings(&[], &[]) };
    let values = marshal(&kernel, &b).unwrap();
    let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
    use Value::*;
    for (name, expected) in [
        ("q_ptr", Ptr(10)),
        ("k_ptr", Ptr(11)),
        ("v_ptr", Ptr(12)),
        ("q_descale", Ptr(80)),
        ("q_descale_stride", I32(1)),
        ("k_descale", Ptr(81)),
        ("k_descale_stride", I32(0)),
        ("v_descale", Ptr(82)),
        ("scale", F32(0.125)),
    ] {
        assert_eq!(value(name), expected, "{name}");
    }
    assert!(matches!(marshal(&kernel, &Bindings { descales: None, ..b }), Err(Error::KernelAbi { .. })));
    let tiles = emit_e4m3_v_tiles(&spec, 224);
    let values = marshal(&tiles, &Bindings { v_tiles: 97, ..bindings(&[], &[]) }).unwrap();
    let value = |name: &str| values[tiles.args.iter().position(|a| a.name == name).unwrap()];
    assert_eq!(value("v_tiles_out"), Ptr(97));
    assert_eq!(value("v_ptr"), Ptr(12));
}

/// A decode kernel over packed queries binds their prefix sums and
/// tokens from the varlen bindings and the plan's `q_len` as
/// `max_q_len`; Q and O have no batch stride; without the varlen
/// bindings it is refused. Its grid is the padded kernel's.
#[test]
fn varlen_decode_kernels_marshal_their_sequences() {
    use flashgen_codegen::cuda::{emit_decode_with, DecodeCache, DecodeConfig, DecodeQueries, Target};
    let spec = flashgen_codegen::parse_one("D { dtype: bf16, head_dim: 64 }").unwrap();
    let config = DecodeConfig::for_rows(&spec, Target::HOPPER, 8).unwrap();
    let decode = Some(DecodeBindings { kv_lens: 94, splits: 5, partial: [95, 96], counters: 98 });
    let varlen = Some(VarlenBindings { cu_seqlens: [91, 0], tokens: [300, 0] });
    let paged = Some(PagedBindings { kv_lens: 94, block_table: 97, pages_per_seq: 6, page_size: 16, num_pages: 40 });
    for (cache, paged) in [(DecodeCache::Dense, None), (DecodeCache::Paged, paged)] {
        let kernel = emit_decode_with(&spec, config, cache, DecodeQueries::Packed);
        let b = Bindings { decode, varlen, paged, ..bindings(&[], &[]) };
        let values = marshal(&kernel, &b).unwrap();
        let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
        use Value::*;
        for (name, expected) in [
            ("cu_seqlens_q", Ptr(91)),
            ("total_q", I32(300)),
            ("max_q_len", I32(129)),
            ("q_seq_stride", I64(2)),
            ("o_head_stride", I64(12)),
            ("kv_lens", Ptr(94)),
            ("num_splits", I32(5)),
        ] {
            assert_eq!(value(name), expected, "{cache:?} {name}");
        }
        for gone in ["q_len", "q_batch_stride", "o_batch_stride"] {
            assert!(!kernel.args.iter().any(|a| a.name == gone), "{cache:?}: {gone}");
        }
        let mut inline = [Value::I32(0); INLINE_ARGS];
        let count = marshal_into(&kernel, &b, &mut inline).unwrap();
        assert_eq!(&inline[..count], &values[..]);
        assert!(matches!(marshal(&kernel, &Bindings { varlen: None, ..b }), Err(Error::KernelAbi { .. })));
        assert_eq!(launch_config(&kernel, &SHAPE, 5, 132).unwrap().grid_dim, (33 * 5, 2, 3));
    }
}

/// The varlen backward kernels bind their sequences as the forward's do,
/// and the gradients' token and head strides.
#[test]
fn varlen_backward_kernels_marshal_their_sequences() {
    use flashgen_codegen::cuda::{emit_backward_varlen, BackwardConfig, BackwardPass, Target};
    let spec = flashgen_codegen::parse_one("C { dtype: bf16, head_dim: 128, mask: q >= k }").unwrap();
    let grads = || GradBindings {
        ptrs: [20, 21, 22, 23],
        strides: [[0, 13, 14], [0, 15, 16], [0, 17, 18], [0, 19, 20]],
        delta: 24,
        dq_accum: 25,
        dq_tickets: 26,
        tensor_grads: &[],
    };
    let varlen = Some(VarlenBindings { cu_seqlens: [91, 92], tokens: [500, 700] });
    let maps = [Operand::Q, Operand::K, Operand::V, Operand::DO];
    let tensor_maps = Some(maps.map(|op| (op, crate::tma::TensorMap::ZERO)).into_iter().collect());
    let b = || Bindings { varlen, tensor_maps, grads: Some(grads()), ..bindings(&[], &[]) };
    let configs = [BackwardConfig::default_for(&spec), BackwardConfig::preferred(&spec, Target::for_sm(9, 0))];
    for (config, pass) in configs.into_iter().flat_map(|c| {
        [BackwardPass::Preprocess, BackwardPass::KeyValue, BackwardPass::Query, BackwardPass::Postprocess]
            .map(|pass| (c, pass))
    }) {
        let kernel = emit_backward_varlen(&spec, pass, config);
        let values = marshal(&kernel, &b()).unwrap();
        let value = |name: &str| kernel.args.iter().position(|a| a.name == name).map(|i| values[i]);
        use Value::*;
        for (name, expected) in [
            ("cu_seqlens_q", Ptr(91)),
            ("max_q_len", I32(129)),
            ("total_q", I32(500)),
            ("dq_seq_stride", I64(15)),
            ("dk_head_stride", I64(18)),
        ] {
            let got = value(name);
            assert!(got.is_none() || got == Some(expected), "{name} in {pass:?}: {got:?}");
        }
        assert!(kernel.args.iter().all(|a| !matches!(a.kind, ArgKind::Stride(_, Axis::Batch))), "{pass:?}");
        assert!(marshal(&kernel, &Bindings { varlen: None, ..b() }).is_err(), "{pass:?}");
    }
}

#[test]
fn dangling_indices_are_abi_errors() {
    for kind in [ArgKind::Param(1), ArgKind::Tensor(1), ArgKind::Param(2)] {
        let args = [ArgInfo::I32(1), ArgInfo::Tensor(ElemTy::I32, 1)];
        let err = marshal(&kernel(&[kind]), &bindings(&args, &[5])).unwrap_err();
        assert!(matches!(err, Error::KernelAbi { .. }), "{kind:?}: {err}");
    }
}

#[test]
fn grid_covers_every_query_tile() {
    let cfg = launch_config(&kernel(&[]), &SHAPE, 1, 132).unwrap();
    assert_eq!((cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes), ((3, 8, 3), (128, 1, 1), 1024));
    let mut k = kernel(&[]);
    k.grid = Grid::MaskTiles;
    assert_eq!(launch_config(&k, &SHAPE, 6, 132).unwrap().grid_dim, (1, 3, 6));
    // Persistent: per_sm blocks per SM, but never more than the 72 items.
    k.grid = Grid::Persistent { per_sm: 1 };
    assert_eq!(launch_config(&k, &SHAPE, 1, 132).unwrap().grid_dim, (72, 1, 1));
    assert_eq!(launch_config(&k, &SHAPE, 1, 16).unwrap().grid_dim, (16, 1, 1));
    k.grid = Grid::Persistent { per_sm: 2 };
    assert_eq!(launch_config(&k, &SHAPE, 1, 16).unwrap().grid_dim, (32, 1, 1));
    assert_eq!(launch_config(&k, &SHAPE, 1, 132).unwrap().grid_dim, (72, 1, 1));
    // Its items' coordinates are decoded in 31 bits: 2^31 items are refused.
    let huge = Shape { batch: 256, heads: 256, heads_kv: 256, q_len: 64 << 15, kv_len: 64 };
    assert!(matches!(launch_config(&k, &huge, 1, 132), Err(Error::TooLarge { value: 2_147_483_648, .. })));
    let most = Shape { batch: 255, ..huge };
    assert!(launch_config(&k, &most, 1, 132).is_ok());
    // Persistent dK/dV: a block per SM, never more than the units (one key
    // tile of 32 × 2 K/V heads × 3 batch rows here), numbered in 31 bits.
    k.grid = Grid::KeyUnits;
    assert_eq!(launch_config(&k, &SHAPE, 1, 132).unwrap().grid_dim, (6, 1, 1));
    assert_eq!(launch_config(&k, &SHAPE, 1, 4).unwrap().grid_dim, (4, 1, 1));
    let long = Shape { batch: 256, heads: 256, heads_kv: 256, q_len: 64, kv_len: 32 << 15 };
    assert!(matches!(launch_config(&k, &long, 1, 132), Err(Error::TooLarge { value: 2_147_483_648, .. })));
    assert!(launch_config(&k, &Shape { batch: 255, ..long }, 1, 132).is_ok());
    k.block_n = 0;
    assert!(matches!(launch_config(&k, &SHAPE, 1, 132), Err(Error::KernelAbi { .. })));
    k.block_n = 32;
    // Work orders: one block per few heads (8 here) or K/V heads (2) of a batch.
    k.grid = Grid::Heads { per_block: 3 };
    assert_eq!(launch_config(&k, &SHAPE, 1, 132).unwrap().grid_dim, (1, 3, 3));
    k.grid = Grid::KvHeads { per_block: 3 };
    assert_eq!(launch_config(&k, &SHAPE, 1, 132).unwrap().grid_dim, (1, 1, 3));
    k.grid = Grid::Heads { per_block: 0 };
    assert!(matches!(launch_config(&k, &SHAPE, 1, 132), Err(Error::KernelAbi { .. })));
    k.grid = Grid::Heads { per_block: 1 };
    k.block_m = 0;
    assert!(matches!(launch_config(&k, &SHAPE, 1, 132), Err(Error::KernelAbi { .. })));
}
