//! The tile each (spec, shape class) launches in, remembered in memory by
//! one runtime: tuned, or the preferred one for want of a tuning record.
//! One table for the forward's configurations, one for the dK/dV kernel's
//! tiles, one for ragged launches' configurations (by their longest
//! sequence's `tile_choice::KeyClass`).

use crate::spec_key::{Keyed, SpecKey};
use crate::tuning::ShapeClass;
use flashgen_codegen::cuda::TileConfig;
use flashgen_codegen::Spec;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{PoisonError, RwLock};

/// What a launch of one class uses: a forward [`TileConfig`], or a
/// backward launch's dK/dV tile.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice<C = TileConfig> {
    pub config: C,
    /// Chosen by timing; else the preferred one, for want of a record.
    pub tuned: bool,
}

/// The choice per spec and class `K` (a shape class), found by the
/// borrowed spec ([`SpecKey`]): a lookup allocates nothing.
pub(crate) struct Choices<C = TileConfig, K = ShapeClass>(RwLock<HashMap<SpecKey<K>, Choice<C>>>);

impl<C, K> Default for Choices<C, K> {
    fn default() -> Self {
        Choices(RwLock::default())
    }
}

impl<C: Copy, K: Copy + Eq + Hash> Choices<C, K> {
    /// The remembered choice of `class` of `spec`, if any.
    pub fn get(&self, spec: &Spec, class: K) -> Option<Choice<C>> {
        let choices = self.0.read().unwrap_or_else(PoisonError::into_inner);
        choices.get(&(spec, class) as &dyn Keyed<K>).copied()
    }

    /// Remembers `choice` unless the class has one already (a tuning that
    /// finished meanwhile wins); returns the one remembered.
    pub fn keep_first(&self, spec: &Spec, class: K, choice: Choice<C>) -> Choice<C> {
        let mut choices = self.0.write().unwrap_or_else(PoisonError::into_inner);
        *choices.entry(SpecKey::new(spec, class)).or_insert(choice)
    }

    /// Remembers `choice`, replacing the class's previous one.
    pub fn replace(&self, spec: &Spec, class: K, choice: Choice<C>) {
        let mut choices = self.0.write().unwrap_or_else(PoisonError::into_inner);
        choices.insert(SpecKey::new(spec, class), choice);
    }
}
