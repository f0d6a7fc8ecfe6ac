//! Autotuning the backward's dK/dV kernel: time each of its tiles
//! ([`Runtime::backward_candidates`]) on the caller's buffers, a whole
//! backward pass per launch (every tile computes the same gradients), keep
//! the fastest per (spec, shape class) and remember it in memory and in the
//! disk cache's `tuning/` records, beside the forward's and apart from them.
//!
//! Whether 64- or 128-query steps pay off, or transposed tiles above
//! d = 192, depends on what the runtime cannot see: how a block mask cuts
//! the tiles (short documents waste most of a long step) and how a score
//! mod's terms weigh. Dense launches without dropout use the tuned tile;
//! [`BackwardOptions::tile`] overrides it.

use crate::args::ArgValue;
use crate::autotune::TuneReport;
use crate::backward::{BackwardIo, BackwardOptions};
use crate::choices::Choice;
use crate::dropout_error::DropoutError;
use crate::element::Element;
use crate::error::Error;
use crate::runtime::Runtime;
use crate::timing::median_ms;
use crate::tuning::Pass;
use flashgen_codegen::cuda::{BackwardConfig, BackwardTile};
use flashgen_codegen::{Shape, Spec};

/// Untimed passes per candidate (the first compiles its kernels).
const WARMUP: usize = 2;
/// Timed passes per candidate; the median counts.
const RUNS: usize = 5;

impl Runtime {
    /// The dK/dV tiles a backward tuning of `spec` times: those of
    /// [`BackwardConfig::tiles`] in the preferred tile's MMA (on Hopper the
    /// wgmma kernel's layouts that cover the head dims, elsewhere the
    /// `mma.sync` tiles that fit), the preferred one first.
    pub fn backward_candidates(&self, spec: &Spec) -> Vec<BackwardTile> {
        let target = self.target();
        let mma = BackwardConfig::preferred(spec, target).mma;
        BackwardConfig::tiles(spec, target).into_iter().filter(|tile| tile.mma == mma).collect()
    }

    /// Times every tile of [`Runtime::backward_candidates`] on these
    /// operands — for each, two untimed backward passes (the first compiles
    /// its kernels) and the median of five CUDA-event timings — and
    /// remembers the fastest for the launch's [`ShapeClass`](crate::ShapeClass), in memory and
    /// (unless `FLASHGEN_CACHE=off`) in the disk cache. Later dense backward
    /// launches of the class without a tile of their own use it.
    ///
    /// Every pass writes dQ, dK, dV and the requested tensor gradients (the
    /// last one's stand), and tuning waits for the GPU. `opts.tile` is
    /// ignored; `opts.dropout` must be `None` (a tuned tile serves launches
    /// without dropout). Operands, arguments and options are checked first,
    /// as [`Runtime::backward`] checks them; then a tile that fails to
    /// compile or launch is reported and skipped, and only if all fail is it
    /// an error ([`Error::Tuning`]).
    pub fn autotune_backward<T: Element>(
        &self,
        spec: &Spec,
        mut io: BackwardIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &BackwardOptions<'_>,
    ) -> Result<TuneReport<BackwardTile>, Error> {
        if opts.dropout.is_some() {
            return Err(Error::Dropout(DropoutError::Unsupported { launch: "backward tuning" }));
        }
        let (q, k) = (io.q.1, io.k.1);
        let shape = Shape { batch: q.batch, heads: q.heads, heads_kv: k.heads, q_len: q.seq, kv_len: k.seq };
        let class = self.shape_class(spec, &shape);
        let tiles = self.backward_candidates(spec);
        // A launch's checks first: bad operands are the caller's error, not
        // every tile's failure.
        self.backward(spec, io.reborrow(), args, &BackwardOptions { tile: Some(tiles[0]), ..*opts })?;
        if shape.batch == 0 || shape.q_len == 0 || shape.kv_len == 0 {
            return Ok(TuneReport { spec: spec.name.clone(), class, best: tiles[0], candidates: Vec::new() });
        }
        let candidates = tiles
            .into_iter()
            .map(|tile| {
                let opts = BackwardOptions { tile: Some(tile), ..*opts };
                (tile, median_ms(self.stream(), WARMUP, RUNS, || self.backward(spec, io.reborrow(), args, &opts)))
            })
            .collect();
        self.keep_fastest((Pass::Backward, &self.backward_choices), spec, class, candidates)
    }

    /// The tuned dK/dV tile of a dense backward launch of `spec` at `shape`
    /// without dropout or a tile of its own, tuned first where tuning on
    /// launches is on and the class has none yet; `None`: untuned (the
    /// preferred tile).
    pub(crate) fn backward_tile_for<T: Element>(
        &self,
        spec: &Spec,
        (shape, io): (Shape, &mut BackwardIo<'_, T>),
        args: &[ArgValue<'_>],
        opts: &BackwardOptions<'_>,
    ) -> Result<Option<BackwardTile>, Error> {
        let choice = self.backward_choice(spec, &shape);
        if !choice.tuned && self.autotune_launches {
            return self.autotune_backward(spec, io.reborrow(), args, opts).map(|report| Some(report.best));
        }
        Ok(choice.tuned.then_some(choice.config))
    }

    /// The dK/dV tile autotuning chose for backward launches of `spec` at
    /// `shape`'s class (remembered by this runtime or found in the disk
    /// cache), if any.
    pub fn tuned_backward_tile(&self, spec: &Spec, shape: &Shape) -> Option<BackwardTile> {
        let choice = self.backward_choice(spec, shape);
        choice.tuned.then_some(choice.config)
    }

    fn backward_choice(&self, spec: &Spec, shape: &Shape) -> Choice<BackwardTile> {
        let class = self.shape_class(spec, shape);
        let preferred = || BackwardConfig::preferred_for(spec, self.target(), class.q_len_bound()).tile();
        let candidates = || self.backward_candidates(spec);
        self.remembered((Pass::Backward, &self.backward_choices), spec, class, candidates, preferred)
    }
}
