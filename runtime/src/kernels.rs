//! Kernel identity: which kernel of a spec a launch or a precompile needs
//! ([`Which`], [`KernelSet`]), and one compiled and loaded on a device
//! ([`LoadedKernel`]).

use cudarc::driver::CudaFunction;
use flashgen_codegen::abi::Kernel;
use flashgen_codegen::cuda::{self, ColumnsParam, Target, TileConfig, TileCopy};
use flashgen_codegen::Spec;
use std::borrow::Cow;

/// Which kernel of a spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Which {
    /// Made by [`Which::forward`].
    Forward(TileConfig, TileCopy),
    /// The forward with dropout, made by [`Which::forward_with`].
    ForwardDropout(TileConfig, TileCopy),
    /// The varlen forward in a configuration, copying as it says (made by
    /// [`Which::forward`]'s rule: one copy where there is no choice).
    ForwardVarlen(TileConfig, TileCopy),
    /// The paged forward in a configuration, copying as it says (as
    /// `ForwardVarlen`).
    ForwardPaged(TileConfig, TileCopy),
    /// The forward on e4m3 operands in a configuration (it copies with TMA).
    ForwardE4m3(TileConfig),
    /// The e4m3 forward's V tiles, of as many keys as its tiles.
    E4m3VTiles(u32),
    /// The paged append into caches of the spec's head dims.
    PagedAppend,
    BlockMask,
    /// A work order under the spec's block mask.
    WorkOrder(cuda::Work),
    Backward(cuda::BackwardPass, cuda::BackwardConfig),
    /// The decode kernel in a configuration (`cuda::DecodeConfig::for_rows`)
    /// over a dense or paged cache, its queries padded or packed.
    Decode(cuda::DecodeConfig, cuda::DecodeCache, cuda::DecodeQueries),
    /// Made by [`Which::backward_varlen`].
    BackwardVarlen(cuda::BackwardPass, cuda::BackwardConfig),
    /// Context parallelism's merge of a forward piece into the running O
    /// and LSE.
    MergePartial,
    /// Context parallelism's add of a backward piece (dQ, dK or dV).
    AddPartial,
    /// Context parallelism's add of captured tensors' f32 gradients.
    AddF32,
}

/// Which kernels of a spec to precompile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSet {
    /// The forward kernel and, for a masked spec, the block-mask kernel.
    Inference,
    /// Those and the four backward kernels (preprocess, dK/dV, the
    /// deterministic dQ, the dQ postprocess), for short sequences and long
    /// where their untuned configurations differ (`BackwardConfig::preferred_for`),
    /// and, under a data-dependent mask, the dK/dV kernel's work order.
    Training,
    /// Every kernel a launch of the spec may use: those of `Training`, the
    /// forward in every configuration autotuning may pick, copying both
    /// ways where it has the choice, the varlen and paged forwards in each,
    /// the paged append, the decode kernels, dense and paged, with padded and
    /// packed queries (one and two row tiles), the varlen backward, the
    /// e4m3 forward and its V tiles (on Hopper), dropout's forward (in the
    /// preferred configurations) and its dK/dV and dQ kernels, and context
    /// parallelism's merge and adds (not in `Training`: plain training
    /// launches never use them, and they compile in a fraction of a second
    /// on first use).
    Every,
}

/// The kernels `set` names for `spec` on `arch`, generated (no NVRTC): what
/// `flashgen check --all` compiles.
pub fn spec_kernels(spec: &Spec, set: KernelSet, arch: crate::Arch) -> Vec<Kernel> {
    let specs = Which::launch_kernels(spec, set, arch.target());
    specs.iter().flat_map(|(spec, which)| which.iter().filter_map(|w| w.emit(spec))).collect()
}

/// Appends `w` to `which` unless it is there already (short and long
/// sequences' configurations share some kernels).
fn push_new(which: &mut Vec<Which>, w: Which) {
    if !which.contains(&w) {
        which.push(w);
    }
}

impl Which {
    /// The specs whose kernels launches of `spec` compile, each with the
    /// kernels `set` names for it: `spec` with all of them, then, where a
    /// launch's param may bound its global columns (`crate::bounded_columns`),
    /// each bounded form (one per column tile) with its forward kernels.
    pub(crate) fn launch_kernels(spec: &Spec, set: KernelSet, target: Target) -> Vec<(Cow<'_, Spec>, Vec<Which>)> {
        let mut specs = vec![(Cow::Borrowed(spec), Which::all(spec, set, target))];
        let Some(columns) = ColumnsParam::of(spec, target) else { return specs };
        for keys in ColumnsParam::TILE_KEYS {
            if let Some(bounded) = columns.bounded(spec, keys) {
                let all = Which::all(&bounded, set, target);
                let forwards = all.into_iter().filter(|w| matches!(w, Which::Forward(..))).collect();
                specs.push((Cow::Owned(bounded), forwards));
            }
        }
        specs
    }

    /// The kernels `set` names for `spec` on `target` (the forward in its
    /// configurations without tuning).
    pub(crate) fn all(spec: &Spec, set: KernelSet, target: Target) -> Vec<Which> {
        if Which::wide_heads(spec) {
            return Which::wide_decoders(spec, set, target);
        }
        // Short keys' and long keys' forward (tile_choice::preferred_for).
        let forward =
            [crate::tile_choice::preferred(spec, target), crate::tile_choice::preferred_for(spec, target, usize::MAX)];
        // Copying with TMA, as launches on contiguous operands do.
        let mut which = vec![Which::forward(forward[0], TileCopy::Tma)];
        if spec.mask.is_some() {
            which.push(Which::BlockMask);
        }
        if forward[1] != forward[0] {
            which.push(Which::forward(forward[1], TileCopy::Tma));
        }
        // Persistent forwards' item orders under a data-dependent mask.
        for config in forward.iter().filter(|c| c.persistent()) {
            if let Some(order) = Which::work_order(spec, cuda::Work::QueryTiles { block_m: config.block_m() }) {
                push_new(&mut which, order);
            }
        }
        if set != KernelSet::Inference {
            use cuda::BackwardPass::{KeyValue, Postprocess, Preprocess, Query};
            // Long sequences' configuration and short ones' (BackwardConfig::preferred_for).
            let config = cuda::BackwardConfig::preferred(spec, target);
            let short = cuda::BackwardConfig::preferred_for(spec, target, 0);
            which.extend(Which::work_order(spec, cuda::Work::KeyTiles { block_n: config.block_n(spec) }));
            for config in [config, short] {
                let mut passes: Vec<Which> =
                    [Preprocess, KeyValue, Query, Postprocess].map(|pass| Which::backward(pass, config)).into();
                // The dK/dV kernel without tensor gradients, for calls that ask for none.
                if !cuda::trainable_tensors(spec).is_empty() {
                    passes.push(Which::backward(KeyValue, cuda::BackwardConfig { tensor_grads: false, ..config }));
                }
                passes.into_iter().for_each(|pass| push_new(&mut which, pass));
            }
        }
        if set == KernelSet::Every {
            let mut add = |w: Which| push_new(&mut which, w);
            add(Which::PagedAppend);
            for config in TileConfig::feasible(spec, target) {
                add(Which::forward(config, TileCopy::Tma));
                add(Which::forward(config, TileCopy::Threads));
                for copy in [TileCopy::Tma, TileCopy::Threads] {
                    add(Which::ForwardVarlen(config, config.kernel_copy(copy)));
                    add(Which::ForwardPaged(config, config.kernel_copy(copy)));
                }
                let order = Which::work_order(spec, cuda::Work::QueryTiles { block_m: config.block_m() });
                if let (true, Some(order)) = (config.persistent(), order) {
                    add(order);
                }
            }
            for rows in [16, 32] {
                if let Some(config) = cuda::DecodeConfig::for_rows(spec, target, rows) {
                    for cache in [cuda::DecodeCache::Dense, cuda::DecodeCache::Paged] {
                        for queries in [cuda::DecodeQueries::Padded, cuda::DecodeQueries::Packed] {
                            add(Which::Decode(config, cache, queries));
                        }
                    }
                }
            }
            // The varlen backward, with and without tensor gradients, copying
            // with TMA and with threads.
            use cuda::BackwardPass::{KeyValue, Postprocess, Preprocess, Query};
            for copy in [TileCopy::Tma, TileCopy::Threads] {
                let config = cuda::BackwardConfig { copy, ..cuda::BackwardConfig::preferred(spec, target) };
                for pass in [Preprocess, KeyValue, Query, Postprocess] {
                    add(Which::backward_varlen(pass, config));
                }
                if !cuda::trainable_tensors(spec).is_empty() {
                    add(Which::backward_varlen(KeyValue, cuda::BackwardConfig { tensor_grads: false, ..config }));
                }
            }
            // The e4m3 forward in its configuration, with its V tiles.
            if let Some(config) = crate::tile_choice::e4m3(spec, target) {
                add(Which::ForwardE4m3(config));
                add(Which::E4m3VTiles(config.block_n));
            }
            // Dropout's forward in the preferred configurations, and its
            // dK/dV and dQ kernels.
            for config in forward {
                add(Which::forward_with(config, TileCopy::Tma, true));
            }
            let dropout = cuda::BackwardConfig::preferred(spec, target).with_dropout(spec, true);
            add(Which::backward(KeyValue, dropout));
            add(Which::backward(Query, dropout));
            which.extend([Which::MergePartial, Which::AddPartial, Which::AddF32]);
        }
        which
    }

    /// Whether `spec`'s head dims exceed what kernels other than the decode
    /// kernel take ([`flashgen_codegen::MAX_HEAD_DIM`]).
    pub(crate) fn wide_heads(spec: &Spec) -> bool {
        spec.head_dims.qk.max(spec.head_dims.v) > flashgen_codegen::MAX_HEAD_DIM
    }

    /// A spec of wide heads (MLA's 576 / 512) has its decode kernels alone:
    /// with `Every`, dense and paged, padded and packed queries, one and two
    /// row tiles, V read from K's tiles (MLA's cache) and, where its stages
    /// fit, from a tensor of its own.
    fn wide_decoders(spec: &Spec, set: KernelSet, target: Target) -> Vec<Which> {
        let mut which = Vec::new();
        if set != KernelSet::Every {
            return which;
        }
        for (rows, v_in_k) in [(16, true), (32, true), (16, false)] {
            let Ok(config) = cuda::DecodeConfig::choose(spec, target, rows, cuda::KvCacheDtype::Spec, v_in_k) else {
                continue;
            };
            for cache in [cuda::DecodeCache::Dense, cuda::DecodeCache::Paged] {
                for queries in [cuda::DecodeQueries::Padded, cuda::DecodeQueries::Packed] {
                    push_new(&mut which, Which::Decode(config, cache, queries));
                }
            }
        }
        which
    }

    /// The kernel's family, as errors name it.
    pub(crate) fn family(self) -> &'static str {
        match self {
            Which::Forward(..)
            | Which::ForwardDropout(..)
            | Which::ForwardVarlen(..)
            | Which::ForwardPaged(..)
            | Which::ForwardE4m3(_)
            | Which::E4m3VTiles(_) => "forward",
            Which::PagedAppend => "paged append",
            Which::BlockMask => "block-mask",
            Which::WorkOrder(_) => "work-order",
            Which::Backward(..) | Which::BackwardVarlen(..) => "backward",
            Which::Decode(..) => "decode",
            Which::MergePartial | Which::AddPartial | Which::AddF32 => "context-parallel",
        }
    }

    /// The work-order kernel for `work`: only under a data-dependent mask,
    /// where the persistent forward and the dK/dV kernel take an order.
    pub(crate) fn work_order(spec: &Spec, work: cuda::Work) -> Option<Which> {
        spec.mask.as_ref().is_some_and(|mask| mask.reads_tensor()).then_some(Which::WorkOrder(work))
    }

    /// The forward kernel in `config`, copying as `copy` says where the
    /// configuration has the choice ([`TileConfig::kernel_copy`]).
    pub(crate) fn forward(config: TileConfig, copy: TileCopy) -> Which {
        Which::Forward(config, config.kernel_copy(copy))
    }

    /// [`Which::forward`], or its dropout kernel where `dropout`.
    pub(crate) fn forward_with(config: TileConfig, copy: TileCopy, dropout: bool) -> Which {
        match Which::forward(config, copy) {
            Which::Forward(config, copy) if dropout => Which::ForwardDropout(config, copy),
            which => which,
        }
    }

    /// Backward kernel `pass` in `config`, keyed by the fields its kernel
    /// reads ([`cuda::BackwardConfig::for_pass`]).
    pub(crate) fn backward(pass: cuda::BackwardPass, config: cuda::BackwardConfig) -> Which {
        Which::Backward(pass, config.for_pass(pass))
    }

    /// Varlen backward kernel `pass` in `config`, keyed as
    /// [`Which::backward`]'s.
    pub(crate) fn backward_varlen(pass: cuda::BackwardPass, config: cuda::BackwardConfig) -> Which {
        Which::BackwardVarlen(pass, config.for_pass(pass))
    }

    /// The kernel of `spec`; `None` for the block mask of a spec without a
    /// mask, for a work order of one without a data-dependent mask, and for
    /// an e4m3 forward in a configuration that cannot run it.
    pub(crate) fn emit(self, spec: &Spec) -> Option<Kernel> {
        match self {
            Which::Forward(config, copy) => Some(cuda::emit_forward_copying(spec, config, copy)),
            Which::ForwardDropout(config, copy) => Some(cuda::emit_forward_dropout(spec, config, copy)),
            Which::ForwardVarlen(config, copy) => Some(cuda::emit_forward_varlen(spec, config, copy)),
            Which::ForwardPaged(config, copy) => Some(cuda::emit_forward_paged(spec, config, copy)),
            Which::ForwardE4m3(config) => cuda::emit_forward_e4m3(spec, config),
            Which::E4m3VTiles(block_n) => Some(cuda::emit_e4m3_v_tiles(spec, block_n)),
            Which::PagedAppend => Some(cuda::emit_paged_append(spec)),
            Which::BlockMask => cuda::emit_block_mask(spec),
            Which::WorkOrder(work) => cuda::emit_work_order(spec, work),
            Which::Backward(pass, config) => Some(cuda::emit_backward_with(spec, pass, config)),
            Which::Decode(config, cache, queries) => Some(cuda::emit_decode_with(spec, config, cache, queries)),
            Which::BackwardVarlen(pass, config) => Some(cuda::emit_backward_varlen(spec, pass, config)),
            Which::MergePartial => Some(cuda::emit_merge_partial(spec)),
            Which::AddPartial => Some(cuda::emit_add_partial(spec)),
            Which::AddF32 => Some(cuda::emit_add_f32(spec)),
        }
    }
}

/// A generated kernel, compiled and loaded on a device.
pub struct LoadedKernel {
    kernel: Kernel,
    function: CudaFunction,
}

impl LoadedKernel {
    pub(crate) fn new(kernel: Kernel, function: CudaFunction) -> LoadedKernel {
        LoadedKernel { kernel, function }
    }

    /// The kernel's source and launch contract.
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    pub fn function(&self) -> &CudaFunction {
        &self.function
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashgen_codegen::abi::ArgKind;
    use flashgen_codegen::parse_str;

    /// The shipped specs and the language-feature ones.
    fn specs() -> Vec<Spec> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut paths: Vec<_> = std::fs::read_dir(root.join("specs")).unwrap().map(|e| e.unwrap().path()).collect();
        paths.push(root.join("codegen/tests/specs/language.attn"));
        paths.iter().flat_map(|p| parse_str(&std::fs::read_to_string(p).unwrap()).unwrap()).collect()
    }

    fn takes_order(kernel: &Kernel) -> bool {
        kernel.args.iter().any(|a| a.kind == ArgKind::WorkOrder)
    }

    #[test]
    fn every_kernel_a_set_names_exists() {
        let sets = [KernelSet::Inference, KernelSet::Training, KernelSet::Every];
        for (spec, target) in specs().iter().flat_map(|s| [(s, Target::for_sm(8, 0)), (s, Target::HOPPER)]) {
            for which in sets.iter().flat_map(|&set| Which::all(spec, set, target)) {
                assert!(which.emit(spec).is_some(), "{}: {which:?}", spec.name);
            }
        }
    }

    /// A launch of param sinks beside a window may run the spec bounded to
    /// any column tile (`crate::bounded_columns`): precompiling names their
    /// forwards too, and nothing else of theirs.
    #[test]
    fn bounded_forms_come_with_their_forwards() {
        let source =
            "S { dtype: bf16, head_dim: 64, param c: i32, param w: i32, mask: k < c || (q >= k && q - k < w) }";
        let spec = flashgen_codegen::parse_one(source).unwrap();
        for set in [KernelSet::Inference, KernelSet::Training] {
            let specs = Which::launch_kernels(&spec, set, Target::HOPPER);
            assert_eq!(specs.len(), 1 + ColumnsParam::TILE_KEYS.len());
            assert_eq!(specs[0].1, Which::all(&spec, set, Target::HOPPER));
            for (bounded, which) in &specs[1..] {
                assert_ne!(**bounded, spec);
                assert!(!which.is_empty() && which.iter().all(|w| matches!(w, Which::Forward(..))), "{which:?}");
                assert!(which.iter().all(|w| w.emit(bounded).is_some()));
            }
        }
        assert_eq!(Which::launch_kernels(&spec, KernelSet::Every, Target::for_sm(8, 0)).len(), 1);
        let literal = flashgen_codegen::parse_one(&source.replace("k < c", "k < 4")).unwrap();
        assert_eq!(Which::launch_kernels(&literal, KernelSet::Every, Target::HOPPER).len(), 1);
    }

    /// Launches compile the work order with their kernel (`Runtime::load_launch`)
    /// before they see the kernel's arguments: the order they name is the one
    /// the kernel takes.
    #[test]
    fn work_orders_loaded_ahead_are_the_kernels_own() {
        for spec in specs() {
            for target in [Target::for_sm(8, 0), Target::HOPPER] {
                for config in TileConfig::feasible(&spec, target) {
                    let kernel = cuda::emit_forward_with(&spec, config);
                    let order = Which::work_order(&spec, cuda::Work::QueryTiles { block_m: config.block_m() });
                    assert_eq!(order.is_some() && config.persistent(), takes_order(&kernel), "{}", kernel.name);
                    assert_eq!(kernel.block_m, config.block_m());
                }
                let config = cuda::BackwardConfig::preferred(&spec, target);
                let pass = cuda::BackwardPass::KeyValue;
                let varlen = cuda::BackwardConfig { copy: TileCopy::Threads, ..config };
                for kernel in
                    [cuda::emit_backward_with(&spec, pass, config), cuda::emit_backward_varlen(&spec, pass, varlen)]
                {
                    let order = Which::work_order(&spec, cuda::Work::KeyTiles { block_n: config.block_n(&spec) });
                    assert_eq!(order.is_some(), takes_order(&kernel), "{}", kernel.name);
                    assert_eq!(kernel.block_n, config.block_n(&spec));
                }
            }
        }
    }

    /// MLA's head dims (576 / 512): a spec of them parses, its `Every` set
    /// is its decode kernels (V read from K's tiles where V's own stages do
    /// not fit), and every other kernel family is a typed refusal.
    #[test]
    fn wide_head_dims_have_their_decoders_alone() {
        let mla = parse_str("Mla { dtype: bf16, head_dim: 576, v_head_dim: 512 }").unwrap().remove(0);
        assert!(Which::wide_heads(&mla));
        for target in [Target::for_sm(8, 0), Target::HOPPER, Target::for_sm(8, 6)] {
            // The forward's and backward's configurations are still chosen (then refused by
            // `load_which`, `Error::WideHeadDims`), without a panic.
            let _ = (crate::tile_choice::preferred(&mla, target), cuda::BackwardConfig::preferred(&mla, target));
            assert!(Which::all(&mla, KernelSet::Inference, target).is_empty());
            let every = Which::all(&mla, KernelSet::Every, target);
            assert!(!every.is_empty() && every.iter().all(|w| w.family() == "decode"), "{target:?}: {every:?}");
            for which in every {
                let kernel = which.emit(&mla).unwrap();
                assert!(kernel.source.contains("constexpr int DV = 512;"), "{}", kernel.name);
            }
        }
        let sm86 = Which::all(&mla, KernelSet::Every, Target::for_sm(8, 6));
        assert!(sm86.iter().all(|w| matches!(w, Which::Decode(c, ..) if c.v_in_k)), "V's own stages do not fit");
        let hopper = Which::all(&mla, KernelSet::Every, Target::HOPPER);
        assert_eq!(hopper.len(), 12, "V in K at one and two row tiles, V of its own at one: {hopper:?}");
        assert_eq!(Which::BlockMask.family(), "block-mask");
    }
}
