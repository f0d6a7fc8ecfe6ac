//! A spec as a key of the runtime's in-memory maps (compiled kernels by
//! `Which`, tuning choices by shape class), found with a borrowed spec: a
//! launch neither prints the spec nor allocates to look it up, and no hash
//! decides which kernel it gets.
//!
//! A key hashes a few cheap fields of its spec (name, dtype, head dims,
//! declaration counts) and compares in full ([`Spec::same_structure`]: every
//! field, floats by their bits), so specs that share those fields only
//! share a bucket: a collision costs a comparison, never a wrong kernel.
//! What persists (disk cache, tuning records) keys on the canonical text
//! instead, stable across processes and versions.

use flashgen_codegen::Spec;
use std::borrow::Borrow;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// A map's own key: a copy of a spec, and `T` (a kernel's `Which`, a
/// shape class).
#[derive(Clone, Debug)]
pub(crate) struct SpecKey<T> {
    spec: Arc<Spec>,
    with: T,
}

impl<T> SpecKey<T> {
    /// The key of `spec` with `with`, for inserting: copies the spec.
    pub fn new(spec: &Spec, with: T) -> SpecKey<T> {
        SpecKey { spec: Arc::new(spec.clone()), with }
    }
}

/// A key's parts, owned ([`SpecKey`]) or borrowed (a lookup's `(&Spec,
/// T)`): a map of owned keys is searched with a borrowed one through
/// `Borrow<dyn Keyed<T>>`, both hashed and compared alike.
pub(crate) trait Keyed<T> {
    fn parts(&self) -> (&Spec, T);
}

impl<T: Copy> Keyed<T> for SpecKey<T> {
    fn parts(&self) -> (&Spec, T) {
        (&self.spec, self.with)
    }
}

impl<T: Copy> Keyed<T> for (&Spec, T) {
    fn parts(&self) -> (&Spec, T) {
        (self.0, self.1)
    }
}

impl<'a, T: Copy + 'a> Borrow<dyn Keyed<T> + 'a> for SpecKey<T> {
    fn borrow(&self) -> &(dyn Keyed<T> + 'a) {
        self
    }
}

impl<T: Hash> Hash for dyn Keyed<T> + '_ {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let (spec, with) = self.parts();
        // Cheap fields only: equality decides (see the module note).
        (&spec.name, spec.dtype, spec.head_dims, spec.params.len(), spec.tensors.len(), with).hash(state);
    }
}

impl<T: Eq> PartialEq for dyn Keyed<T> + '_ {
    fn eq(&self, other: &Self) -> bool {
        let ((a, x), (b, y)) = (self.parts(), other.parts());
        x == y && a.same_structure(b)
    }
}

impl<T: Eq> Eq for dyn Keyed<T> + '_ {}

// An owned key hashes and compares as its borrowed form, as `Borrow` requires.
impl<T: Copy + Hash> Hash for SpecKey<T> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (self as &dyn Keyed<T>).hash(state);
    }
}

impl<T: Copy + Eq> PartialEq for SpecKey<T> {
    fn eq(&self, other: &Self) -> bool {
        (self as &dyn Keyed<T>) == (other as &dyn Keyed<T>)
    }
}

impl<T: Copy + Eq> Eq for SpecKey<T> {}

#[cfg(test)]
mod tests;
