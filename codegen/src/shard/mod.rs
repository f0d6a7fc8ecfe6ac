//! Context parallelism on the CPU: how a sequence is split over ranks
//! ([`Sharding`]), which (query segment, key segment) pieces a rank computes
//! ([`rank_pieces`]), and the view of a spec its kernels are emitted from
//! ([`view`]).
//!
//! A piece is one ordinary attention launch over a query segment and a key
//! segment of the whole sequence. Its kernels read the spec through the
//! shard view, where `q`, `k`, `q_len` and `kv_len` mean the whole
//! sequence's positions and lengths, so every spec means on a shard what it
//! means on one GPU; the pieces' outputs merge exactly by their LSEs.

mod plan;
mod view;

pub use plan::{rank_pieces, Partition, Piece, Segment, Sharding};
pub use view::{view, ShardParams, SHARD_PARAMS};
