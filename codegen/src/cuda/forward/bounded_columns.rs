//! A launch's global columns, bounded by its param's value. Under
//! `k < C || rest` with C an i32 param and `rest` a band (sinks beside a
//! window), the forward walks the whole mask (`ColumnShare::FirstTile`),
//! since C may pass the column tile. A launch knows C, though: where C's
//! keys fit a tile of at most 64, the runtime launches the spec with C
//! bounded, `k < min(C, n)` (n the tile's keys, which this C does not
//! pass: the same mask at this launch), whose forward takes the columns
//! apart from its walk as a literal C's does ([`columns_apart`]).

use super::plan::columns_apart;
use crate::cuda::target::{Mma, Target};
use crate::mask_parts::{GlobalColumns, MaskParts};
use crate::spec::{BinOp, Expr, ExprKind, Func, Spec, Ty};

/// The param C of a spec's global columns beside a band, which a launch's
/// value may bound ([`ColumnsParam::bounded`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColumnsParam {
    /// C's index among the spec's params.
    pub param: usize,
    /// Whether the columns are `k <= C` (key C is one of them).
    inclusive: bool,
}

impl ColumnsParam {
    /// The column tiles a launch's C may be bounded to, in keys.
    pub const TILE_KEYS: [u32; 4] = [16, 32, 48, 64];

    /// Where `spec`'s global columns are `k < C` for an i32 param C and
    /// the spec bounded ([`ColumnsParam::bounded`]) takes them apart from its
    /// walk on `target`: its param, else `None` (a literal C, no band beside
    /// it, a spec term per key, head dims above 64, a target without
    /// wgmma, whose kernels have no column tile).
    pub fn of(spec: &Spec, target: Target) -> Option<ColumnsParam> {
        if target.mma != Mma::Wgmma {
            return None;
        }
        let global = MaskParts::of(spec.mask.as_ref())?.global_columns()?;
        let ExprKind::Param(param) = global.bound.kind else { return None };
        let columns = ColumnsParam { param, inclusive: global.inclusive };
        columns_apart(&columns.bounded(spec, 16)?).then_some(columns)
    }

    /// The column tile's keys for C's value `c` at a launch: the columns'
    /// keys rounded up to 16, where they are at most 64; `None` past that.
    pub fn keys(self, c: i32) -> Option<u32> {
        let end = i64::from(c) + i64::from(self.inclusive);
        (end <= 64).then(|| u32::try_from(end.max(1)).map_or(16, |end| end.next_multiple_of(16)))
    }

    /// `spec` with C bounded to a tile of `keys` keys: `k < min(C, keys)`
    /// (`k <= min(C, keys - 1)`), the same mask at a launch whose C has
    /// those [`ColumnsParam::keys`] or fewer.
    pub fn bounded(self, spec: &Spec, keys: u32) -> Option<Spec> {
        let parts = MaskParts::of(spec.mask.as_ref())?;
        let global = parts.global_columns()?;
        let MaskParts::Disjuncts(list) = &parts else { return None };
        let [first, second] = list[..] else { return None };
        let most = i32::try_from(keys).ok()? - i32::from(self.inclusive);
        let param = Expr { ty: Ty::I32, kind: ExprKind::Param(self.param) };
        let limit = Expr { ty: Ty::I32, kind: ExprKind::Int(most) };
        let bound = Expr { ty: Ty::I32, kind: ExprKind::Call(Func::Min, vec![param, limit]) };
        let columns = GlobalColumns { bound: &bound, ..global }.keep();
        let [first, second] = match global.disjunct {
            0 => [columns, second.clone()],
            _ => [first.clone(), columns],
        };
        let mask = Expr { ty: Ty::Bool, kind: ExprKind::Binary(BinOp::Or, Box::new(first), Box::new(second)) };
        Some(Spec { mask: Some(mask), ..spec.clone() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mask: &str) -> Spec {
        let source = format!("S {{ dtype: bf16, head_dim: 64, param c: i32, param w: i32, mask: {mask} }}");
        crate::parse_one(&source).unwrap()
    }

    fn bounded_source(mask: &str, keys: u32) -> Option<String> {
        let spec = spec(mask);
        let bounded = ColumnsParam::of(&spec, Target::HOPPER)?.bounded(&spec, keys)?;
        Some(crate::syntax::expr_source(&bounded, bounded.mask.as_ref()?))
    }

    #[test]
    fn a_param_beside_a_band_is_bounded_by_its_tile() {
        let window = "(q >= k && q - k < w)";
        assert_eq!(
            bounded_source(&format!("k < c || {window}"), 16).as_deref(),
            Some("k < min(c, 16) || q >= k && q - k < w")
        );
        assert_eq!(
            bounded_source(&format!("{window} || c >= k"), 32).as_deref(),
            Some("q >= k && q - k < w || k <= min(c, 31)")
        );
        // Literal columns, a prefix beside causal attention, global rows too.
        assert_eq!(bounded_source(&format!("k < 4 || {window}"), 16), None);
        assert_eq!(bounded_source("k < c || q >= k", 16), None);
        assert_eq!(bounded_source(&format!("q < c || k < c || {window}"), 16), None);
    }

    #[test]
    fn the_bounded_spec_takes_the_columns_apart() {
        let spec = spec("k < c || (q >= k && q - k < w)");
        assert_eq!(ColumnsParam::of(&spec, Target::PORTABLE), None, "no column tile without wgmma");
        let columns = ColumnsParam::of(&spec, Target::HOPPER).unwrap();
        assert!(!columns_apart(&spec));
        assert!(columns_apart(&columns.bounded(&spec, 48).unwrap()));
    }

    /// Brute force over (q, k) and C: at a launch whose C has the tile's
    /// keys or fewer, the bounded mask keeps exactly the spec's pairs.
    #[test]
    fn the_bounded_mask_is_the_spec_s_wherever_c_fits() {
        use crate::reference::{Arith, Env, ParamValue, Position, Value};
        use crate::spec::Shape;
        let shape = Shape { batch: 1, heads: 1, heads_kv: 1, q_len: 80, kv_len: 100 };
        for body in ["k < c || (q >= k && q - k < w)", "(k - q < w && q - k < w) || c >= k"] {
            let spec = spec(body);
            let columns = ColumnsParam::of(&spec, Target::HOPPER).unwrap();
            for (c, w) in [(-2, 5), (0, 5), (3, 1), (4, 30), (15, 0), (16, 7), (31, 40), (47, 3), (63, 9), (64, 20)] {
                let Some(keys) = columns.keys(c) else { continue };
                let bounded = columns.bounded(&spec, keys).unwrap();
                let params = [ParamValue::I32(c), ParamValue::I32(w)];
                let [whole, bounded] = [&spec, &bounded].map(|spec| {
                    let env = Env::new(spec, &shape, &params, &[], Arith::F64).unwrap();
                    move |q, k| {
                        let at = Position { b: 0, h: 0, q, k, score: 0.0 };
                        env.eval(spec.mask.as_ref().unwrap(), &at) == Value::Bool(true)
                    }
                });
                for (q, k) in (0..80).flat_map(|q| (0..100).map(move |k| (q, k))) {
                    assert_eq!(whole(q, k), bounded(q, k), "{body}, c {c}, w {w} at ({q}, {k})");
                }
            }
        }
    }

    #[test]
    fn keys_round_up_to_16_and_stop_at_64() {
        let spec = spec("k < c || (q >= k && q - k < w)");
        let columns = ColumnsParam::of(&spec, Target::HOPPER).unwrap();
        let keys: Vec<_> = [-3, 0, 1, 4, 16, 17, 63, 64, 65, 5000].map(|c| columns.keys(c)).into();
        let some = |n| Some(n);
        assert_eq!(keys, [some(16), some(16), some(16), some(16), some(16), some(32), some(64), some(64), None, None]);
        let inclusive = ColumnsParam::of(&self::spec("c >= k || (q >= k && q - k < w)"), Target::HOPPER).unwrap();
        assert_eq!(
            (inclusive.keys(15), inclusive.keys(16), inclusive.keys(63), inclusive.keys(64)),
            (some(16), some(32), some(64), None)
        );
    }
}
