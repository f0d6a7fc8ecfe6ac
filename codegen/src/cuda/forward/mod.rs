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
//! On Hopper the same loop runs on `wgmma` (see `wgmma.rs`); with 128-key
//! tiles it is software-pipelined (FlashAttention-3): P·V of tile j is
//! issued behind S of tile j + 1 and runs while the softmax of that S does,
//! so V loads one iteration after its K, O's rescale waits for P·V, and the
//! warpgroups take turns issuing their products. Then it is warp-specialized
//! (see `ring.rs`) and persistent: one more warpgroup issues every copy into
//! a ring of stages, so the warpgroups that multiply never wait at a CTA
//! barrier, and each CTA (one per SM; two of one consumer warpgroup each,
//! which overlap each other instead of taking turns) walks work items it
//! claims from a counter, the next item's loads running while the current
//! one finishes.
//!
//! The spec enters in one place: the `logit` lambda, which maps a dot product
//! at (q, k) to a log2-domain logit, or −∞ where the mask drops the pair.

//!
//! Modules, in the order a kernel is printed: `candidates` and `plan` (the
//! tile configuration and its resources), `constants`, `item` (per-item
//! setup), `classes` (which tiles to visit), `logit`, `kv_loads`, the tile
//! steps (`sync_step`, `wgmma_step`) with `softmax`, `epilogue`; `cta` is
//! the body of kernels whose threads all load and multiply, `persistent`
//! that of the warp-specialized ones (`staged_terms` is their producer's
//! share of the spec).

mod bias;
mod candidates;
mod classes;
mod constants;
mod cta;
mod epilogue;
mod item;
mod key_bounds;
mod kv_loads;
mod logit;
mod persistent;
mod plan;
mod softmax;
mod staged_terms;
mod sync_step;
mod wgmma_step;

use crate::abi::{Grid, Kernel, KernelArg};
use crate::cuda::prelude::PRELUDE;
use crate::cuda::ranges::RANGES;
use crate::cuda::ring::RING;
use crate::cuda::signature::forward_args;
use crate::cuda::source::{kernel_name, write_entry, write_header};
use crate::cuda::target::{pad16, Mma};
use crate::cuda::tile_config::{warp_specialized, TileConfig};
use crate::cuda::tiles::TILES;
use crate::cuda::tma::{TileCopy, TMA, TMA_STORE};
use crate::cuda::wgmma::{write_wgmma_op, AFrom, WGMMA};
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use constants::write_config;
use cta::write_body;
use softmax::RowSums;
use std::fmt::{self, Write};

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
    let name = kernel_name("fwd", spec);
    let copy = warp_specialized(config).then_some(copy);
    let args = forward_args(spec, copy);
    let mut w = Writer::new(String::new());
    write_kernel(&mut w, spec, config, copy, &name, &args).expect("formatting into a String cannot fail");
    Kernel {
        name,
        source: w.into_inner(),
        grid: match warp_specialized(config) {
            true => Grid::Persistent { per_sm: config.per_sm() },
            false => Grid::QueryTiles,
        },
        block_m: config.block_m(),
        block_n: config.block_n,
        threads: config.threads(),
        dynamic_smem: config.smem_bytes(spec),
        args,
    }
}

/// `copy`: how a warp-specialized kernel copies (`None` for the others).
fn write_kernel(
    w: &mut Writer<String>,
    spec: &Spec,
    config: TileConfig,
    copy: Option<TileCopy>,
    name: &str,
    args: &[KernelArg],
) -> fmt::Result {
    write_header(w, spec)?;
    w.write_str(PRELUDE)?;
    writeln!(w)?;
    w.write_str(RANGES)?;
    writeln!(w)?;
    w.write_str(TILES)?;
    writeln!(w)?;
    if config.mma == Mma::Wgmma {
        w.write_str(WGMMA)?;
        write_wgmma_op(w, spec.dtype, config.block_n, AFrom::Shared)?;
        write_wgmma_op(w, spec.dtype, pad16(spec.head_dims.v), AFrom::Registers)?;
        if RowSums::of(spec, config) == RowSums::TensorCores {
            write_wgmma_op(w, spec.dtype, 8, AFrom::Registers)?;
        }
        writeln!(w)?;
    }
    if let Some(copy) = copy {
        w.write_str(RING)?;
        writeln!(w)?;
        w.write_str(persistent::WORK_CLAIMS)?;
        writeln!(w)?;
        if copy == TileCopy::Tma {
            w.write_str(TMA)?;
            w.write_str(TMA_STORE)?;
            writeln!(w)?;
        }
    }
    write_config(w, spec, config)?;
    writeln!(w)?;
    let bounds = match config.per_sm() {
        1 => "CTA_THREADS".to_string(),
        n => format!("CTA_THREADS, {n}"),
    };
    write_entry(w, spec, (name, &bounds), args, |w| write_body(w, spec, config, copy))
}
