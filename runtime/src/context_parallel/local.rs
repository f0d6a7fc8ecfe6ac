//! Every rank of a context-parallel launch on one device: each rank's
//! pieces read the other ranks' K and V where they lie, and their dK and dV
//! add straight into the owners' sums. The pieces, merges and sums are the
//! ones a multi-GPU launch runs; only the exchanges are missing.

use super::pieces::{backward_piece, ForwardAcc, GradAcc, KeyValue, Pieces, RankGradIn, RankOut};
use super::{ShardIo, Whole};
use crate::args::{ArgInfo, ArgValue};
use crate::backward::{BackwardIo, BackwardOptions};
use crate::check_shard::check_ranks;
use crate::element::Element;
use crate::error::Error;
use crate::forward_launch::ForwardOptions;
use crate::runtime::Runtime;
use flashgen_codegen::shard::Sharding;
use flashgen_codegen::Spec;

impl Runtime {
    /// Runs every rank of a context-parallel forward on this device, rank
    /// `r`'s operands in `ranks[r]` (see [`ShardIo`]): the result a launch
    /// over `sharding.ranks` GPUs gives, for any spec, which the same
    /// unsharded launch gives up to rounding. Checks every rank's rows
    /// against `sharding` and `whole`, and the params and tensors (whole
    /// sequence's) against the spec.
    pub fn forward_sharded_local<T: Element>(
        &self,
        spec: &Spec,
        sharding: Sharding,
        whole: Whole,
        ranks: Vec<ShardIo<'_, T>>,
        args: &[ArgValue<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<(), Error> {
        let layouts: Vec<_> = ranks.iter().map(|r| [r.q.1, r.k.1]).collect();
        let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
        let shape = check_ranks(spec, sharding, whole, &layouts, &infos)?;
        let pieces = Pieces::new(spec, shape, sharding, args);
        let kvs: Vec<KeyValue<'_, T>> = ranks.iter().map(|r| [r.k, r.v]).collect();
        for (rank, io) in ranks.into_iter().enumerate() {
            let plan = pieces.of_rank(rank);
            let mut acc = ForwardAcc::new(self, &pieces, rank, &plan)?;
            let mut out = RankOut { q: io.q, o: io.o, lse: io.lse };
            for piece in &plan {
                acc.add(self, &pieces, piece, kvs[piece.kv_rank], &mut out, opts)?;
            }
            acc.finish(self, &pieces, &mut out)?;
        }
        Ok(())
    }

    /// Runs every rank of a context-parallel backward on this device (see
    /// [`BackwardIo`]), after [`Runtime::forward_sharded_local`] wrote the
    /// ranks' O and LSE.
    pub fn backward_sharded_local<T: Element>(
        &self,
        spec: &Spec,
        sharding: Sharding,
        whole: Whole,
        ranks: Vec<BackwardIo<'_, T>>,
        args: &[ArgValue<'_>],
        opts: &BackwardOptions<'_>,
    ) -> Result<(), Error> {
        let layouts: Vec<_> = ranks.iter().map(|r| [r.q.1, r.k.1]).collect();
        let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
        let shape = check_ranks(spec, sharding, whole, &layouts, &infos)?;
        let pieces = Pieces::new(spec, shape, sharding, args);
        let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        let kvs: Vec<KeyValue<'_, T>> = ranks.iter().map(|r| [r.k, r.v]).collect();
        let mut dkvs = (0..sharding.ranks)
            .map(|r| GradAcc::zeros(self, shape.batch, layouts[r][1].seq, shape.heads_kv, &[dqk, dv]))
            .collect::<Result<Vec<_>, _>>()?;
        let mut outs = Vec::new();
        for (rank, io) in ranks.into_iter().enumerate() {
            let BackwardIo { q, o, lse, d_o, dq, dk, dv, mut d_tensors, .. } = io;
            for t in d_tensors.iter_mut().flatten() {
                self.stream().memset_zeros(*t).map_err(|e| Error::driver("zeroing a tensor gradient", e))?;
            }
            let input = RankGradIn { q, o, d_o, lse };
            let mut dq_acc = GradAcc::zeros(self, shape.batch, q.1.seq, shape.heads, &[dqk])?;
            for piece in &pieces.of_rank(rank) {
                let dkv = &mut dkvs[piece.kv_rank];
                backward_piece(
                    self,
                    &pieces,
                    piece,
                    kvs[piece.kv_rank],
                    &input,
                    &mut dq_acc,
                    dkv,
                    &mut d_tensors,
                    opts,
                )?;
            }
            dq_acc.write(self, spec, 0, dq)?;
            outs.push((dk, dv));
        }
        for (acc, (dk, dv)) in dkvs.iter_mut().zip(outs) {
            acc.write(self, spec, 0, dk)?;
            acc.write(self, spec, 1, dv)?;
        }
        Ok(())
    }
}
