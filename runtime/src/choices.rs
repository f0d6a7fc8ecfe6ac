//! The tile each (spec, shape class) launches in, remembered in memory by
//! one runtime: tuned, or the preferred one for want of a tuning record.
//! One table for the forward's configurations, one for the dK/dV kernel's
//! tiles.

use crate::spec_key::{Keyed, SpecKey};
use crate::tuning::ShapeClass;
use flashgen_codegen::cuda::TileConfig;
use flashgen_codegen::Spec;
use std::collections::HashMap;
use std::sync::{PoisonError, RwLock};

/// What a launch of one class uses: a forward [`TileConfig`], or a
/// backward launch's dK/dV tile.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice<C = TileConfig> {
    pub config: C,
    /// Chosen by timing; else the preferred one, for want of a record.
    pub tuned: bool,
}

/// The choice per spec and shape class, found by the borrowed spec
/// ([`SpecKey`]): a lookup allocates nothing.
pub(crate) struct Choices<C = TileConfig>(RwLock<HashMap<SpecKey<ShapeClass>, Choice<C>>>);

impl<C> Default for Choices<C> {
    fn default() -> Self {
        Choices(RwLock::default())
    }
}

impl<C: Copy> Choices<C> {
    /// The remembered choice of `class` of `spec`, if any.
    pub fn get(&self, spec: &Spec, class: ShapeClass) -> Option<Choice<C>> {
        let choices = self.0.read().unwrap_or_else(PoisonError::into_inner);
        choices.get(&(spec, class) as &dyn Keyed<ShapeClass>).copied()
    }

    /// Remembers `choice` unless the class has one already (a tuning that
    /// finished meanwhile wins); returns the one remembered.
    pub fn keep_first(&self, spec: &Spec, class: ShapeClass, choice: Choice<C>) -> Choice<C> {
        let mut choices = self.0.write().unwrap_or_else(PoisonError::into_inner);
        *choices.entry(SpecKey::new(spec, class)).or_insert(choice)
    }

    /// Remembers `choice`, replacing the class's previous one.
    pub fn replace(&self, spec: &Spec, class: ShapeClass, choice: Choice<C>) {
        let mut choices = self.0.write().unwrap_or_else(PoisonError::into_inner);
        choices.insert(SpecKey::new(spec, class), choice);
    }
}
