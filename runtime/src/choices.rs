//! The tile configuration each (spec, shape class) launches in, remembered
//! in memory by one runtime: tuned, or the preferred one for want of a
//! tuning record.

use crate::tuning::ShapeClass;
use flashgen_codegen::cuda::TileConfig;
use std::collections::HashMap;
use std::sync::{PoisonError, RwLock};

/// What a forward launch of one class uses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Choice {
    pub config: TileConfig,
    /// Chosen by timing; else the preferred config, for want of a record.
    pub tuned: bool,
}

/// The choice per canonical spec source and shape class, keyed in two
/// levels so a lookup borrows the source instead of allocating a key.
#[derive(Default)]
pub(crate) struct Choices(RwLock<HashMap<String, HashMap<ShapeClass, Choice>>>);

impl Choices {
    /// The remembered choice of `class` of the spec `spec_source`, if any.
    pub fn get(&self, spec_source: &str, class: ShapeClass) -> Option<Choice> {
        let choices = self.0.read().unwrap_or_else(PoisonError::into_inner);
        choices.get(spec_source).and_then(|classes| classes.get(&class)).copied()
    }

    /// Remembers `choice` unless the class has one already (a tuning that
    /// finished meanwhile wins); returns the one remembered.
    pub fn keep_first(&self, spec_source: &str, class: ShapeClass, choice: Choice) -> Choice {
        let mut choices = self.0.write().unwrap_or_else(PoisonError::into_inner);
        *choices.entry(spec_source.to_string()).or_default().entry(class).or_insert(choice)
    }

    /// Remembers `choice`, replacing the class's previous one.
    pub fn replace(&self, spec_source: &str, class: ShapeClass, choice: Choice) {
        let mut choices = self.0.write().unwrap_or_else(PoisonError::into_inner);
        choices.entry(spec_source.to_string()).or_default().insert(class, choice);
    }
}
