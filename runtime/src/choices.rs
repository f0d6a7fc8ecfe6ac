//! The tile configuration each (spec, shape class) launches in, remembered
//! in memory by one runtime: tuned, or the preferred one for want of a
//! tuning record.

use crate::spec_key::{Keyed, SpecKey};
use crate::tuning::ShapeClass;
use flashgen_codegen::cuda::TileConfig;
use flashgen_codegen::Spec;
use std::collections::HashMap;
use std::sync::{PoisonError, RwLock};

/// What a forward launch of one class uses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice {
    pub config: TileConfig,
    /// Chosen by timing; else the preferred config, for want of a record.
    pub tuned: bool,
}

/// The choice per spec and shape class, found by the borrowed spec
/// ([`SpecKey`]): a lookup allocates nothing.
#[derive(Default)]
pub(crate) struct Choices(RwLock<HashMap<SpecKey<ShapeClass>, Choice>>);

impl Choices {
    /// The remembered choice of `class` of `spec`, if any.
    pub fn get(&self, spec: &Spec, class: ShapeClass) -> Option<Choice> {
        let choices = self.0.read().unwrap_or_else(PoisonError::into_inner);
        choices.get(&(spec, class) as &dyn Keyed<ShapeClass>).copied()
    }

    /// Remembers `choice` unless the class has one already (a tuning that
    /// finished meanwhile wins); returns the one remembered.
    pub fn keep_first(&self, spec: &Spec, class: ShapeClass, choice: Choice) -> Choice {
        let mut choices = self.0.write().unwrap_or_else(PoisonError::into_inner);
        *choices.entry(SpecKey::new(spec, class)).or_insert(choice)
    }

    /// Remembers `choice`, replacing the class's previous one.
    pub fn replace(&self, spec: &Spec, class: ShapeClass, choice: Choice) {
        let mut choices = self.0.write().unwrap_or_else(PoisonError::into_inner);
        choices.insert(SpecKey::new(spec, class), choice);
    }
}
