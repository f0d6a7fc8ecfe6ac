//! The spec a forward launch compiles where its global columns' param fits
//! a column tile: the spec with that param bounded ([`ColumnsParam`]: sinks
//! beside a window, whose forward then takes the columns apart from its
//! walk), remembered per spec and tile, found by the borrowed spec: a
//! launch allocates nothing once its spec and tile were seen.

use crate::args::ArgValue;
use crate::spec_key::{Keyed, SpecKey};
use flashgen_codegen::cuda::{ColumnsParam, Target};
use flashgen_codegen::Spec;
use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

/// Per spec, its columns' param (if any); per spec and tile keys, the
/// bounded spec.
#[derive(Default)]
pub(crate) struct BoundedSpecs {
    params: RwLock<HashMap<SpecKey<()>, Option<ColumnsParam>>>,
    specs: RwLock<HashMap<SpecKey<u32>, Arc<Spec>>>,
}

impl BoundedSpecs {
    /// The spec a forward launch of `spec` with `args` (params first)
    /// compiles in place of `spec`: `None` where its C is not a param, or
    /// passes the largest column tile, or the arguments are not `spec`'s
    /// (the launch's checks then say so).
    pub fn of(&self, spec: &Spec, args: &[ArgValue], target: Target) -> Option<Arc<Spec>> {
        let columns = self.param(spec, target)?;
        let &ArgValue::I32(c) = args.get(columns.param)? else { return None };
        let keys = columns.keys(c)?;
        if let Some(bounded) = read(&self.specs).get(&(spec, keys) as &dyn Keyed<u32>) {
            return Some(bounded.clone());
        }
        let bounded = Arc::new(columns.bounded(spec, keys)?);
        Some(write(&self.specs).entry(SpecKey::new(spec, keys)).or_insert(bounded).clone())
    }

    /// `spec`'s columns param on `target` (one per runtime's device),
    /// weighed once per spec.
    fn param(&self, spec: &Spec, target: Target) -> Option<ColumnsParam> {
        if let Some(&columns) = read(&self.params).get(&(spec, ()) as &dyn Keyed<()>) {
            return columns;
        }
        let columns = ColumnsParam::of(spec, target);
        *write(&self.params).entry(SpecKey::new(spec, ())).or_insert(columns)
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mask: &str) -> Spec {
        let source = format!("S {{ dtype: bf16, head_dim: 64, param c: i32, param w: i32, mask: {mask} }}");
        flashgen_codegen::parse_one(&source).unwrap()
    }

    #[test]
    fn a_launch_bounds_the_columns_where_its_param_fits_a_tile() {
        let specs = BoundedSpecs::default();
        let sinks = spec("k < c || (q >= k && q - k < w)");
        let launch = |c: i32| specs.of(&sinks, &[ArgValue::I32(c), ArgValue::I32(1024)], Target::HOPPER);
        let four = launch(4).expect("4 sinks fit a tile");
        assert!(Arc::ptr_eq(&four, &launch(16).unwrap()), "one bounded spec per tile");
        assert!(!Arc::ptr_eq(&four, &launch(17).unwrap()));
        assert_ne!(*four, sinks);
        assert!(launch(65).is_none());
        // Arguments that are not the spec's: the launch's checks report them.
        assert!(specs.of(&sinks, &[ArgValue::F32(4.0)], Target::HOPPER).is_none());
        assert!(specs.of(&sinks, &[], Target::HOPPER).is_none());
        // No column tile without wgmma; no param columns beside a band.
        let portable = BoundedSpecs::default();
        assert!(portable.of(&sinks, &[ArgValue::I32(4), ArgValue::I32(1024)], Target::PORTABLE).is_none());
        let literal = spec("k < 4 || (q >= k && q - k < w)");
        assert!(specs.of(&literal, &[ArgValue::I32(4), ArgValue::I32(1024)], Target::HOPPER).is_none());
    }
}
