//! The host allocations of a warm forward launch and of a decode plan's
//! run, counted (tests only): every step a launch takes before the
//! driver's calls, once its kernel and tile choice are cached (or its plan
//! made), allocates nothing. The counting allocator counts
//! per thread, so tests running beside this one do not disturb it.

use crate::arch::Arch;
use crate::args::{ArgInfo, ArgValue};
use crate::block_mask::BuiltFor;
use crate::check::{check_forward, Buffer, Problem};
use crate::check_decode::{check_launch, check_paged_launch, check_run_kind, DecodeShape, PagedDecodeProblem, RunKind};
use crate::choices::{Choice, Choices};
use crate::decode::{arg_infos, run_bindings, PlanWords, RunAddresses, SplitParts};
use crate::few::Few;
use crate::kernels::Which;
use crate::layout::Layout;
use crate::marshal::{launch_config, marshal_into, Bindings, PagedBindings, Value, INLINE_ARGS};
use crate::paged::{PagedLayout, PagedShape};
use crate::single_flight::SingleFlight;
use crate::spec_key::{Keyed, SpecKey};
use crate::tma::{TensorMap, TensorMaps};
use crate::tuning::ShapeClass;
use flashgen_codegen::abi::Operand;
use flashgen_codegen::cuda::{
    emit_decode_with, emit_forward_copying, DecodeCache, DecodeConfig, DecodeQueries, KvCacheDtype, Mma, TileConfig,
    TileCopy,
};
use flashgen_codegen::{parse_one, Dtype, ElemTy, Shape};
use std::alloc::{GlobalAlloc, Layout as Block, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: System's allocator, with a count on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, block: Block) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(block) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, block: Block) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, block) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// `f`'s result and the allocations it made on this thread.
fn counted<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = ALLOCATIONS.with(Cell::get);
    let result = f();
    (result, ALLOCATIONS.with(Cell::get) - before)
}

#[test]
fn a_warm_forward_launch_allocates_nothing_before_the_driver() {
    let text = "W { dtype: bf16, head_dim: 128, param window: i32, tensor slopes: f32[H],
        mask: q >= k && q - k < window, score: score + slopes[h] * (k - q) as f32 }";
    // The cache holds its own copy; a launch brings the caller's spec.
    let (cached, spec) = (parse_one(text).unwrap(), parse_one(text).unwrap());
    let config = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 128 };
    let which = Which::forward(config, TileCopy::Tma);
    let kernel = emit_forward_copying(&cached, config, TileCopy::Tma);
    let (q, kv) = (Layout::bshd(2, 1000, 8, 128), Layout::bshd(2, 1000, 2, 128));
    let problem = Problem::new(Dtype::Bf16, [q, kv, kv, q].map(|l| (l, l.len())), None);
    let shape = Shape { batch: 2, heads: 8, heads_kv: 2, q_len: 1000, kv_len: 1000 };
    let args = [ArgInfo::I32(256), ArgInfo::Tensor(ElemTy::F32, 8)];
    let tensors = [0x1000];

    // What the launch's first run left: its kernel, its class's choice, a block mask.
    let kernels = SingleFlight::<SpecKey<Which>, u32>::default();
    kernels.get_or_try_init(SpecKey::new(&cached, which), || Ok::<_, ()>(7)).unwrap();
    let choices = Choices::default();
    choices.keep_first(&cached, ShapeClass::new(&cached, &shape, 132), Choice { config, tuned: true });
    let mask = BuiltFor::new(&cached, shape, &args, &tensors);

    let ((), allocations) = counted(|| {
        let infos = Few::of(ArgInfo::I32(0), args);
        assert_eq!(check_forward(&spec, &problem, &infos).unwrap(), Some(shape));
        let choice = choices.get(&spec, ShapeClass::new(&spec, &shape, 132)).unwrap();
        assert_eq!(choice.config, config);
        assert_eq!(kernels.get(&(&spec, which) as &dyn Keyed<Which>), Some(7));
        mask.check_launch(&spec, shape, &infos, &tensors).unwrap();
        let operands = [Operand::Q, Operand::K, Operand::V, Operand::O];
        let maps: TensorMaps = operands.map(|op| (op, TensorMap::ZERO)).into_iter().collect();
        let bindings = Bindings {
            tensor_maps: Some(maps),
            work_counter: Some(0x2000),
            ..Bindings::without_operands(shape, &infos, &tensors).with_operands([0x3000; 4], [q, kv, kv, q], 0, 0.1)
        };
        let mut values = [Value::I32(0); INLINE_ARGS];
        assert_eq!(marshal_into(&kernel, &bindings, &mut values).unwrap(), kernel.args.len());
        launch_config(&kernel, &shape, 1, 132).unwrap();
    });
    assert_eq!(allocations, 0);
}

#[test]
fn a_paged_decode_run_allocates_nothing_before_the_driver() {
    let spec = parse_one(
        "W { dtype: bf16, head_dim: 128, param window: i32, tensor slopes: f32[H],
        mask: q >= k && q - k < window, score: score + slopes[h] * (k - q) as f32 }",
    )
    .unwrap();
    // The plan: 4 sequences of up to 4096 keys in 16-row pages, 4 splits.
    let plan = DecodeShape { batch: 4, heads: 32, heads_kv: 8, q_len: 1, max_kv_len: 4096 };
    let rows = plan.group_rows() as u32;
    let config = DecodeConfig::choose(&spec, Arch::new(9, 0).target(), rows, KvCacheDtype::Spec, false).unwrap();
    let kernel = emit_decode_with(&spec, config, DecodeCache::Paged, DecodeQueries::Padded);
    let kind = RunKind { cache: DecodeCache::Paged, queries: DecodeQueries::Padded, kv: KvCacheDtype::Spec };
    // A step's buffers as the run sees them: Q and O, the caches, table and lengths.
    let q = Layout::bshd(4, 1, 32, 128);
    let page = PagedLayout::contiguous(1024, 16, 8, 128);
    let cache = (page, page.as_layout().len());
    let problem = PagedDecodeProblem {
        dtype: Dtype::Bf16,
        q: Buffer { layout: q, len: q.len() },
        o: Buffer { layout: q, len: q.len() },
        lse: Some(4 * 32),
        kv: PagedShape {
            caches: [cache, cache],
            table_len: 4 * 256,
            kv_lens_len: 4,
            pages_per_seq: 256,
            max_kv_len: 4096,
            batch: 4,
        },
    };
    let args = [ArgValue::I32(1024)];
    let tensors = [0x1000];
    // The plan's workspace: 4 splits' partial O and LSE rows, and a counter per row tile.
    let workspace = SplitParts::carve(4 * 4 * 32 * 128, 4 * 4 * 32, 32);

    let ((), allocations) = counted(|| {
        check_run_kind(kind, plan.heads_kv, (DecodeCache::Paged, DecodeQueries::Padded), None).unwrap();
        // The tensor's info as a device buffer of 32 floats gives it.
        let mut infos = arg_infos(&spec, &args).unwrap();
        infos[1] = ArgInfo::Tensor(ElemTy::F32, 32);
        let infos = &infos[..2];
        let shape = check_paged_launch(&spec, &problem, infos).unwrap().unwrap();
        check_launch(&plan, &shape, problem.kv.kv_lens_len).unwrap();
        // What `DecodePlan::queue` binds from the addresses its guards give.
        let paged =
            PagedBindings { kv_lens: 0x2000, block_table: 0x3000, pages_per_seq: 256, page_size: 16, num_pages: 1024 };
        let addresses = RunAddresses {
            operands: [(0x7000, q), (0x7100, page.as_layout()), (0x7200, page.as_layout()), (0x7300, q)],
            lse: 0x8000,
            kv_lens: 0x2000,
            paged: Some(paged),
            varlen: None,
            tensors: &tensors,
            workspace: Some((workspace, 0x4000)),
            descales: None,
        };
        let words = PlanWords { splits: 4, scale: 0.1, v_in_k: false };
        let bindings = run_bindings(words, shape, infos, &addresses).unwrap();
        let mut values = [Value::I32(0); INLINE_ARGS];
        assert_eq!(marshal_into(&kernel, &bindings, &mut values).unwrap(), kernel.args.len());
    });
    assert_eq!(allocations, 0);
}
