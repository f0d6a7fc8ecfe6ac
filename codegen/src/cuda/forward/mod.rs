//! The forward kernel: FlashAttention-2 on tensor cores, for any spec.
//!
//! Each CTA owns `BLOCK_M` query rows of one (batch, head), 16 per warp, and
//! streams K/V through shared memory `BLOCK_N` keys at a time in a two-stage
//! `cp.async` pipeline: tile j + 1 loads while tile j is multiplied. S = Q·Kᵀ
//! and O += P·V run on `mma.sync.m16n8k16` with f32 accumulators; S stays in
//! registers, goes through the spec's score and mask and the online softmax
//! (base 2, one rescale per tile), and is repacked in place as the A operand
//! of P·V. No score matrix ever reaches memory.
//!
//! On Hopper the same loop runs on `wgmma` (see `library/wgmma.cuh`); with 128-key
//! tiles it is software-pipelined (FlashAttention-3): P·V of tile j is
//! issued behind S of tile j + 1 and runs while the softmax of that S does,
//! so V loads one iteration after its K, O's rescale waits for P·V, and the
//! warpgroups take turns issuing their products. Then it is warp-specialized
//! (see `library/ring.cuh`) and persistent: one more warpgroup issues every copy into
//! a ring of stages, so the warpgroups that multiply never wait at a CTA
//! barrier, and each CTA (one per SM; two of one consumer warpgroup each,
//! which overlap each other instead of taking turns) walks work items it
//! claims from a counter, the next item's loads running while the current
//! one finishes.
//!
//! The spec enters in one place: the `logit` lambda, which maps a dot product
//! at (q, k) to a log2-domain logit, or −∞ where the mask drops the pair.

//!
//! Modules, in the order a kernel is printed: `plan` (the tile
//! configuration's resources; `light` says which tiles a spec's code fits),
//! `constants`, `item` (per-item setup), `classes` (which tiles to visit),
//! `logit`, `kv_loads`, `global_columns` (the mask's first keys ahead of
//! the tile walk), the tile steps (`sync_step`, `wgmma_step`) with
//! `softmax`, `epilogue`; `trace` prints a traced kernel's trace points;
//! `mma` gathers what differs per MMA kind; `cta` is
//! the body of kernels whose threads all load and multiply, `persistent`
//! that of the warp-specialized ones (`staged_terms` is their producer's
//! share of the spec).

mod bias;
mod bounded_columns;
mod classes;
mod constants;
mod cta;
mod dropout;
mod e4m3;
mod epilogue;
mod global_columns;
mod item;
mod item_order;
mod kv_loads;
mod light;
mod logit;
mod mma;
mod persistent;
mod plan;
mod softmax;
mod staged_terms;
mod sync_step;
mod trace;
mod varlen;
mod wgmma_step;

use crate::abi::{Grid, Kernel, Operand};
use crate::cuda::library::wgmma_ops::AFrom;
use crate::cuda::library::Part;
use crate::cuda::signature::{forward_args, forward_paged_args, forward_varlen_args, with_dropout, with_e4m3};
use crate::cuda::source::{assemble, kernel_name, Entry, Piece};
use crate::cuda::target::{pad16, Mma, Target};
use crate::cuda::tile_config::{warp_specialized, TileConfig, TileCopy};
use crate::cuda::writer::Writer;
use crate::spec::Spec;
pub use bounded_columns::ColumnsParam;
use constants::write_config;
use cta::write_body;
pub use e4m3::e4m3_supports;
use e4m3::Operands;
pub use light::is_light;
pub use persistent::per_warpgroup_classes;
pub use plan::columns_apart;
pub(crate) use plan::TermLevels;
use plan::{walked_view, Plan};
use softmax::RowSums;
use std::fmt::Write;

/// Emits the forward kernel for `spec` with its default tile configuration.
/// Deterministic: the same spec always gives byte-identical source.
pub fn emit_forward(spec: &Spec) -> Kernel {
    emit_forward_with(spec, TileConfig::default_for(spec))
}

/// Emits the forward kernel for `spec` with an explicit tile configuration;
/// a warp-specialized one copies with TMA.
pub fn emit_forward_with(spec: &Spec, config: TileConfig) -> Kernel {
    emit_forward_copying(spec, config, TileCopy::Tma)
}

/// [`emit_forward_with`], copying tiles as `copy` says where the
/// configuration is warp-specialized (the others copy with their threads).
pub fn emit_forward_copying(spec: &Spec, config: TileConfig, copy: TileCopy) -> Kernel {
    let walked = walked_view(spec, config);
    emit(Plan::new(spec, config, copy).walking(walked.as_ref()))
}

/// [`emit_forward_copying`] with dropout on the attention probabilities
/// (see [`crate::dropout`]): P is zeroed or scaled by `1 / (1 − p)` per
/// pair before P V, the LSE is the softmax's; the mask's seed, offset,
/// threshold and scale are trailing arguments ([`ArgKind::Dropout`](crate::abi::ArgKind::Dropout)).
pub fn emit_forward_dropout(spec: &Spec, config: TileConfig, copy: TileCopy) -> Kernel {
    emit(Plan::dropout(spec, config, copy))
}

/// The forward kernel of `spec` in `config` on e4m3 Q, K and V (each with
/// descale factors; O in the spec's dtype), copying with TMA, on Hopper;
/// `None` where `config` cannot run it ([`e4m3_supports`]). Its P·V reads
/// V's tiles as [`emit_e4m3_v_tiles`](crate::cuda::emit_e4m3_v_tiles)
/// writes them (see `e4m3`).
pub fn emit_forward_e4m3(spec: &Spec, config: TileConfig) -> Option<Kernel> {
    e4m3_supports(spec, config, Target::HOPPER).then(|| emit(Plan::e4m3(spec, config)))
}

/// The forward kernel of `spec` in `config` on varlen (packed) operands:
/// tokens of all sequences back to back, `cu_seqlens_q` / `cu_seqlens_k`
/// prefix sums on the device (see `varlen`). Deterministic, like
/// [`emit_forward`]; `copy` applies where `config` is warp-specialized
/// (with TMA, the launch passes ragged descriptors: `library/tma_ragged.cuh`).
pub fn emit_forward_varlen(spec: &Spec, config: TileConfig, copy: TileCopy) -> Kernel {
    emit(Plan::varlen(&spec.varlen_view(), config, copy))
}

/// The forward kernel of `spec` in `config` over paged K/V caches: queries
/// packed (or dense), keys gathered through a block table of pages, each
/// sequence's K/V length on the device (see `varlen`). Deterministic, like
/// [`emit_forward`]; `copy` applies where `config` is warp-specialized
/// (with TMA, K/V tiles go by boxes of whole pages: `library/paged_tma.cuh`).
pub fn emit_forward_paged(spec: &Spec, config: TileConfig, copy: TileCopy) -> Kernel {
    emit(Plan::paged(&spec.varlen_view(), config, copy))
}

/// [`emit_forward_copying`] with `clock64()` trace points, for
/// `scripts/trace/harness.cu`: the library's trace section
/// (`library/trace.cuh`: the `g_trace` rows, `TR`, `TRACE_COUNTER`),
/// `TRACE_COUNTER` at the body's top and `TR(code);` at each of the events
/// of `trace::Event` that the configuration has. Thread 0 of each
/// warpgroup of the first `TRACE_CTAS` CTAs appends `code << 56 | clock64`
/// to its row; compiled with `-DTRACE_ON=0` the points vanish.
/// `None` where `config` is not warp-specialized: the events are the
/// producer's and the consumers'.
pub fn emit_forward_traced(spec: &Spec, config: TileConfig, copy: TileCopy) -> Option<Kernel> {
    let walked = walked_view(spec, config);
    warp_specialized(config)
        .then(|| emit(Plan { trace: true, ..Plan::new(spec, config, copy).walking(walked.as_ref()) }))
}

/// The kernel that `plan` describes.
fn emit(plan: Plan) -> Kernel {
    let (spec, config) = (plan.spec, plan.config);
    let (name, args) = match (plan.paged, plan.varlen) {
        (true, _) => ("fwd_paged", forward_paged_args(spec, plan.copy)),
        (false, true) => ("fwd_varlen", forward_varlen_args(spec, plan.copy)),
        (false, false) if plan.dropout => ("fwd_dropout", with_dropout(spec, forward_args(spec, plan.copy), true)),
        (false, false) if plan.operands == Operands::E4m3 => {
            ("fwd_e4m3", with_e4m3(spec, forward_args(spec, plan.copy), &[Operand::Q, Operand::K, Operand::V]))
        }
        (false, false) => ("fwd", forward_args(spec, plan.copy)),
    };
    let name = kernel_name(name, spec);
    let bounds = match config.per_sm() {
        1 => "CTA_THREADS".to_string(),
        n => format!("CTA_THREADS, {n}"),
    };
    let config_lines = |w: &mut Writer<String>| {
        write_config(w, &plan)?;
        writeln!(w)
    };
    let entry = Entry { name: &name, bounds: &bounds, args: &args };
    let source = assemble(spec, &library(&plan), config_lines, entry, |w| write_body(w, &plan));
    Kernel {
        name,
        source,
        grid: match warp_specialized(config) {
            true => Grid::Persistent { per_sm: config.per_sm() },
            false => Grid::QueryTiles,
        },
        block_m: config.block_m(),
        block_n: config.block_n,
        threads: config.threads(),
        dynamic_smem: plan.smem_bytes,
        args,
    }
}

/// The library sections a forward kernel uses.
fn library(plan: &Plan) -> Vec<Vec<Piece>> {
    let (spec, config) = (plan.spec, plan.config);
    let mut sections =
        vec![vec![Piece::Part(Part::Prelude)], vec![Piece::Part(Part::Ranges)], vec![Piece::Part(Part::Tiles)]];
    if plan.operands == Operands::E4m3 {
        sections.push(vec![
            Piece::Part(Part::Wgmma),
            Piece::Part(Part::ForwardE4m3),
            Piece::Wgmma(config.block_n, AFrom::E4m3Shared),
            Piece::Wgmma(pad16(spec.head_dims.v), AFrom::E4m3Registers),
        ]);
    } else if config.mma == Mma::Wgmma {
        let s_from = if plan.q_fragments { AFrom::RegistersKMajorB } else { AFrom::Shared };
        let mut wgmma = vec![
            Piece::Part(Part::Wgmma),
            Piece::Wgmma(config.block_n, s_from),
            Piece::Wgmma(pad16(spec.head_dims.v), AFrom::Registers),
        ];
        if plan.row_sums == RowSums::TensorCores {
            wgmma.push(Piece::Wgmma(8, AFrom::Registers));
        }
        if let Some(columns) = plan.columns.filter(|c| c.keys != config.block_n) {
            wgmma.push(Piece::Wgmma(columns.keys, AFrom::Shared));
        }
        sections.push(wgmma);
    }
    if plan.copy.is_some() {
        sections.push(vec![Piece::Part(Part::Ring)]);
        sections.push(vec![Piece::Part(Part::WorkClaims)]);
    }
    if plan.varlen {
        sections.push(vec![Piece::Part(Part::Varlen)]);
    }
    if plan.paged {
        sections.push(vec![Piece::Part(Part::Paged)]);
    }
    if plan.copy == Some(TileCopy::Tma) {
        let mut tma = vec![Piece::Part(Part::Tma), Piece::Part(Part::TmaStore)];
        if plan.varlen {
            tma.push(Piece::Part(Part::TmaRagged));
        }
        if plan.paged {
            tma.push(Piece::Part(Part::PagedTma));
        }
        sections.push(tma);
    }
    if plan.trace {
        sections.push(vec![Piece::Part(Part::Trace)]);
    }
    if plan.dropout {
        sections.push(vec![Piece::Part(Part::Dropout)]);
    }
    sections
}
