//! The kit every kernel is built from: spec expressions in C, hoisting of
//! spec terms, tile classification and the tile walk. Kernels import the
//! kit, never each other.

pub(crate) mod dropout;
pub(crate) mod expr;
pub(crate) mod hoist;
pub(crate) mod key_bounds;
pub(crate) mod logit;
pub(crate) mod terms;
pub(crate) mod tile_class;
pub(crate) mod tile_walk;
pub(crate) mod varlen;
pub(crate) mod warp_roles;
