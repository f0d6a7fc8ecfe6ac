//! A mask's top-level parts, each of which decides some partial tiles alone:
//! of `a && b` the conjunct that does not hold throughout a tile (a sliding
//! window's diagonal runs the causal test alone), of `a || b || c` the one
//! disjunct that keeps any pair of a tile where the others keep none
//! (Longformer's band away from its global rows and columns, the window of
//! sinks-plus-window away from its sinks). The kernel then tests that part
//! alone, often as key bounds (`cuda/forward/key_bounds.rs`), instead of the
//! whole mask.
//!
//! The forward's tile walk sends each partial tile's *selector* in two bits
//! of its tile word: 0 where the whole mask must be evaluated, else a value
//! naming the deciding part ([`MaskParts::deciding`]). [`MaskParts::selector`]
//! is the CPU twin of the kernels' classification, from the same interval
//! arithmetic ([`crate::analysis`]), so tests can check it against brute
//! force.

use crate::analysis::{classify_expr, TileClass};
use crate::reference::ParamValue;
use crate::spec::{BinOp, Builtin, Expr, ExprKind, Func, Shape, Ty};

/// The most disjuncts a mask may split into: a selector is two bits, 0 and
/// one value per disjunct.
pub const MAX_DISJUNCTS: usize = 3;

/// The parts of a mask that may decide a partial tile alone.
#[derive(Clone, Debug, PartialEq)]
pub enum MaskParts<'e> {
    /// `a && b`: where one conjunct keeps every pair of a tile, the other
    /// decides it.
    Conjuncts([&'e Expr; 2]),
    /// `a || b` or `a || b || c` (nested `||` flattened), no tensor read:
    /// where all disjuncts but one keep no pair of a tile, that one decides
    /// it if it reads k ([`MaskParts::decides`]). A tensor-reading mask keeps
    /// the whole test: its disjuncts are rarely empty by analysis, and the
    /// extra element loops would not pay.
    Disjuncts(Vec<&'e Expr>),
}

impl<'e> MaskParts<'e> {
    /// The parts of `mask`, when it has two conjuncts or two to
    /// [`MAX_DISJUNCTS`] disjuncts.
    pub fn of(mask: Option<&'e Expr>) -> Option<Self> {
        let mask = mask?;
        match &mask.kind {
            ExprKind::Binary(BinOp::And, a, b) => Some(MaskParts::Conjuncts([&**a, &**b])),
            ExprKind::Binary(BinOp::Or, ..) if !mask.reads_tensor() => {
                let mut out = Vec::new();
                flatten_or(mask, &mut out);
                (out.len() <= MAX_DISJUNCTS).then_some(MaskParts::Disjuncts(out))
            }
            _ => None,
        }
    }

    /// The parts, in the mask's order.
    pub fn exprs(&self) -> &[&'e Expr] {
        match self {
            MaskParts::Conjuncts(pair) => pair,
            MaskParts::Disjuncts(list) => list,
        }
    }

    /// The disjunct that makes the first rows global ([`GlobalRows`]).
    pub fn global_rows(&self) -> Option<GlobalRows<'e>> {
        self.first_of(Builtin::Q).map(|(_, bound, inclusive)| GlobalRows { bound, inclusive })
    }

    /// The disjunct that makes the first keys global ([`GlobalColumns`]).
    pub fn global_columns(&self) -> Option<GlobalColumns<'e>> {
        self.first_of(Builtin::K).map(|(disjunct, bound, inclusive)| GlobalColumns { disjunct, bound, inclusive })
    }

    /// A mask `columns || rest` of two disjuncts, one of them global
    /// columns `k < C`: those columns and `rest && k >= C`, the pairs it
    /// keeps past them (`k >= C` joins rest's last conjunct, so that a
    /// window's causal first conjunct stays on its own).
    pub fn past_columns(&self) -> Option<(GlobalColumns<'e>, Expr)> {
        let MaskParts::Disjuncts(list) = self else { return None };
        let columns = self.global_columns().filter(|_| list.len() == 2)?;
        let rest = list[1 - columns.disjunct];
        let and =
            |a: Expr, b: Expr| Expr { ty: Ty::Bool, kind: ExprKind::Binary(BinOp::And, Box::new(a), Box::new(b)) };
        let past = match &rest.kind {
            ExprKind::Binary(BinOp::And, a, b) => and((**a).clone(), and((**b).clone(), columns.past())),
            _ => and(rest.clone(), columns.past()),
        };
        Some((columns, past))
    }

    /// The first disjunct `x < R` (or `x <= R`, `R > x`, `R >= x`) with R a
    /// literal, an i32 param or a param a literal bounds (`min(p, 16)`, see
    /// [`GlobalColumns::most`]): its index, R and whether it is inclusive.
    fn first_of(&self, x: Builtin) -> Option<(usize, &'e Expr, bool)> {
        let MaskParts::Disjuncts(list) = self else { return None };
        list.iter().enumerate().find_map(|(index, e)| {
            let ExprKind::Binary(op, a, b) = &e.kind else { return None };
            let is_x = |e: &Expr| e.kind == ExprKind::Builtin(x);
            let fixed = |e: &Expr| fixed(e) || literal_bound(e).is_some();
            let (bound, inclusive) = match op {
                BinOp::Lt | BinOp::Le if is_x(a) && fixed(b) => (&**b, *op == BinOp::Le),
                BinOp::Gt | BinOp::Ge if is_x(b) && fixed(a) => (&**a, *op == BinOp::Ge),
                _ => return None,
            };
            Some((index, bound, inclusive))
        })
    }

    /// Whether part `x` decides the tiles it is alone on: every conjunct,
    /// and a disjunct that reads k. A disjunct without k (Longformer's
    /// global rows, `q < g`) keeps all or none of a row, so a tile is
    /// partial under it alone only where the tile's rows cross its edge,
    /// which is too rare to pay for an element loop of its own.
    pub fn decides(&self, x: usize) -> bool {
        match self {
            MaskParts::Conjuncts(_) => x < 2,
            MaskParts::Disjuncts(list) => list.get(x).is_some_and(|e| e.uses(Builtin::K)),
        }
    }

    /// The part that decides a tile of selector `selector` alone; `None`:
    /// the whole mask. Conjuncts: bit x says conjunct x keeps every pair,
    /// so 1 leaves conjunct 1 and 2 conjunct 0 (3 is a full tile, which
    /// evaluates no mask). Disjuncts: x + 1 names disjunct x.
    pub fn deciding(&self, selector: u32) -> Option<usize> {
        match (self, selector) {
            (MaskParts::Conjuncts(_), 1) => Some(1),
            (MaskParts::Conjuncts(_), 2) => Some(0),
            (MaskParts::Disjuncts(_), s) if s > 0 && self.decides(s as usize - 1) => Some(s as usize - 1),
            _ => None,
        }
    }

    /// The selector of the tile of queries `q` × keys `k` (inclusive), as
    /// the kernels classify it: 0 unless every key of the tile exists (the
    /// deciding part's test checks no bound at kv_len), else from each
    /// part's class over the tile.
    pub fn selector(&self, shape: &Shape, params: &[ParamValue], b: i32, h: i32, q: (i32, i32), k: (i32, i32)) -> u32 {
        if i64::from(k.1) >= shape.kv_len as i64 {
            return 0;
        }
        let class = |e: &Expr| classify_expr(e, shape, params, b, h, q, k);
        match self {
            MaskParts::Conjuncts([a, b]) => {
                u32::from(class(a) == TileClass::Full) | u32::from(class(b) == TileClass::Full) << 1
            }
            MaskParts::Disjuncts(list) => {
                let live: Vec<usize> = (0..list.len()).filter(|&x| class(list[x]) != TileClass::Empty).collect();
                match live[..] {
                    [x] if self.decides(x) => x as u32 + 1,
                    _ => 0,
                }
            }
        }
    }
}

/// A disjunct `q < R` (or `q <= R`, `R > q`, `R >= q`) with R a literal or
/// an i32 param: the first rows of every (batch, head) are global, each
/// keeps every key, so their query tiles are an item's longest.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GlobalRows<'e> {
    /// R.
    pub bound: &'e Expr,
    /// Whether row R is global too (`<=`, `>=`).
    pub inclusive: bool,
}

impl GlobalRows<'_> {
    /// The query tiles of `block_m` rows out of `q_tiles` that hold a global
    /// row, given R's value: the kernels' `dense_tiles`.
    pub fn dense_tiles(&self, bound: i32, q_len: i64, block_m: i64) -> i64 {
        let rows = i64::from(bound) + i64::from(self.inclusive);
        let q_tiles = (q_len + block_m - 1) / block_m;
        match rows {
            ..=0 => 0,
            r if r >= q_len => q_tiles,
            r => (r + block_m - 1) / block_m,
        }
    }
}

/// A disjunct `k < C` (or `k <= C`, `C > k`, `C >= k`) with C a literal or
/// an i32 param: the first keys of every (batch, head) are global, every
/// query keeps them (attention sinks, Longformer's global columns). The
/// forward takes them ahead of its tile walk where no other disjunct keeps
/// a pair of the first tile (`cuda/forward/global_columns.rs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GlobalColumns<'e> {
    /// The disjunct's index among the mask's disjuncts.
    pub disjunct: usize,
    /// C.
    pub bound: &'e Expr,
    /// Whether key C is global too (`<=`, `>=`).
    pub inclusive: bool,
}

impl GlobalColumns<'_> {
    /// The most C can be: a literal's value, or the literal that bounds a
    /// param (`min(p, 16)`); `None` for a param.
    pub fn most(&self) -> Option<i32> {
        match self.bound.kind {
            ExprKind::Int(c) => Some(c),
            _ => literal_bound(self.bound),
        }
    }

    /// The key tiles of `block_n` keys out of `key_tiles` that hold a
    /// global column, given C's value: the dK/dV kernels' `global_tiles`.
    pub fn key_tiles(&self, bound: i32, key_tiles: i64, block_n: i64) -> i64 {
        match i64::from(bound) + i64::from(self.inclusive) {
            ..=0 => 0,
            keys => ((keys + block_n - 1) / block_n).min(key_tiles),
        }
    }

    /// `k < C` (`k <= C` where inclusive): the columns themselves.
    pub fn keep(&self) -> Expr {
        self.k_against(if self.inclusive { BinOp::Le } else { BinOp::Lt })
    }

    /// `k >= C` (`k > C` where inclusive): the keys past the columns.
    pub fn past(&self) -> Expr {
        self.k_against(if self.inclusive { BinOp::Gt } else { BinOp::Ge })
    }

    fn k_against(&self, op: BinOp) -> Expr {
        let k = Expr { ty: Ty::I32, kind: ExprKind::Builtin(Builtin::K) };
        Expr { ty: Ty::Bool, kind: ExprKind::Binary(op, Box::new(k), Box::new(self.bound.clone())) }
    }
}

/// An i32 literal or param.
fn fixed(e: &Expr) -> bool {
    matches!(e.kind, ExprKind::Int(_) | ExprKind::Param(_)) && e.ty == Ty::I32
}

/// The literal n of `min(p, n)` (or `min(n, p)`), an i32 param bounded.
fn literal_bound(e: &Expr) -> Option<i32> {
    let ExprKind::Call(Func::Min, args) = &e.kind else { return None };
    let [a, b] = &args[..] else { return None };
    match (&a.kind, &b.kind) {
        (ExprKind::Param(_), ExprKind::Int(n)) | (ExprKind::Int(n), ExprKind::Param(_)) if fixed(a) && fixed(b) => {
            Some(*n)
        }
        _ => None,
    }
}

/// The (batch, head) pair (`bh` = b · heads + h) and query tile of work
/// item `item` when global rows go first: the `dense_tiles` first query
/// tiles of every (batch, head) are the first items, tile by tile, so that
/// no long item is left for a launch's end; then the other tiles of each
/// (batch, head), last rows first (the order without global rows). The
/// twin of the kernels' decode (`forward/item_order.rs`).
pub fn global_rows_first(item: i64, bhs: i64, q_tiles: i64, dense_tiles: i64) -> (i64, i64) {
    let dense_items = dense_tiles * bhs;
    if item < dense_items {
        return (item % bhs, item / bhs);
    }
    let (rest, tiles) = (item - dense_items, q_tiles - dense_tiles);
    (rest / tiles, q_tiles - 1 - rest % tiles)
}

/// About how many items [`longest_tail_last`] orders tile by tile (and
/// how many CTAs the dK/dV grid's last band spans, [`global_columns_first`]'s
/// `tail_ctas`): two waves of CTAs on a 132-SM GPU.
pub const TAIL_ITEMS: i64 = 256;

/// The (batch, head) pair and query tile of work item `item` of a
/// persistent forward without global rows: each pair's tiles in turn, last
/// rows first, and under a mask the last pairs of about `tail_items` items
/// tile by tile, so that their longest tiles start first and the launch
/// ends on their shortest. The twin of the kernels' decode
/// (`forward/item_order.rs`).
pub fn longest_tail_last(item: i64, bhs: i64, q_tiles: i64, tail_items: i64) -> (i64, i64) {
    let tail_bhs = bhs.min((tail_items + q_tiles - 1) / q_tiles);
    let tail_start = (bhs - tail_bhs) * q_tiles;
    if item < tail_start {
        return (item / q_tiles, q_tiles - 1 - item % q_tiles);
    }
    let rest = item - tail_start;
    (bhs - tail_bhs + rest % tail_bhs, q_tiles - 1 - rest / tail_bhs)
}

/// The (pair, key tile) of the dK/dV CTA started `cta`-th under an
/// analytic mask, of `pairs` (batch, K/V head) pairs and `key_tiles` key
/// tiles each: the `global_tiles` first key tiles of every pair first, tile
/// by tile, so that no CTA that walks every query is left for the grid's
/// end; then bands of `band` pairs, key tile by key tile, the last one
/// widened to the last pairs of about `tail_ctas` CTAs. The twin of the
/// kernels' decode (`cuda/backward/dkdv.rs`).
pub fn global_columns_first(
    cta: i64,
    pairs: i64,
    key_tiles: i64,
    global_tiles: i64,
    band: i64,
    tail_ctas: i64,
) -> (i64, i64) {
    if cta < global_tiles * pairs {
        return (cta % pairs, cta / pairs);
    }
    let (rest, tiles) = (cta - global_tiles * pairs, key_tiles - global_tiles);
    let tail_pairs = band.max((tail_ctas + tiles - 1) / tiles);
    let tail_first = (pairs - tail_pairs).max(0) / band * band;
    let first = if rest < tail_first * tiles { rest / (band * tiles) * band } else { tail_first };
    let band_pairs = if first == tail_first { pairs - tail_first } else { band };
    let in_band = rest - first * tiles;
    (first + in_band % band_pairs, global_tiles + in_band / band_pairs)
}

/// The operands of `e`'s nested top-level `||`s, left to right.
fn flatten_or<'e>(e: &'e Expr, out: &mut Vec<&'e Expr>) {
    match &e.kind {
        ExprKind::Binary(BinOp::Or, a, b) => {
            flatten_or(a, out);
            flatten_or(b, out);
        }
        _ => out.push(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_one;

    fn mask(body: &str) -> Expr {
        let spec = parse_one(&format!(
            "S {{ dtype: bf16, head_dim: 64, param w: i32, param g: i32, tensor doc: i32[B, KV_LEN], mask: {body} }}"
        ))
        .unwrap();
        spec.mask.unwrap()
    }

    fn count(body: &str) -> Option<(bool, usize)> {
        let e = mask(body);
        MaskParts::of(Some(&e)).map(|p| (matches!(p, MaskParts::Conjuncts(_)), p.exprs().len()))
    }

    #[test]
    fn recognizes_conjuncts_and_up_to_three_disjuncts() {
        assert_eq!(count("q >= k"), None);
        assert_eq!(count("q >= k && q - k < w"), Some((true, 2)));
        assert_eq!(count("k < g || q >= k"), Some((false, 2)));
        assert_eq!(count("(q - k <= w && k - q <= w) || q < g || k < g"), Some((false, 3)));
        assert_eq!(count("k < g || (q >= k || (q < g || k > w))"), None);
        assert_eq!(count("doc[b][q] == doc[b][k] || k < g"), None);
    }

    #[test]
    fn global_rows_are_a_disjunct_bounding_q_by_a_constant() {
        let rows = |body: &str| {
            let e = mask(body);
            let parts = MaskParts::of(Some(&e))?;
            parts.global_rows().map(|g| (g.inclusive, matches!(g.bound.kind, ExprKind::Param(_))))
        };
        assert_eq!(rows("(q - k <= w && k - q <= w) || q < g || k < g"), Some((false, true)));
        assert_eq!(rows("k < g || 7 >= q"), Some((true, false)));
        assert_eq!(rows("k < g || q >= k"), None);
        assert_eq!(rows("q < g && k < g"), None);
        assert_eq!(rows("k < g || q < k"), None);
    }

    #[test]
    fn global_columns_are_a_disjunct_bounding_k_by_a_constant() {
        let columns = |body: &str| {
            let e = mask(body);
            let parts = MaskParts::of(Some(&e))?;
            parts.global_columns().map(|g| (g.disjunct, g.inclusive, matches!(g.bound.kind, ExprKind::Param(_))))
        };
        assert_eq!(columns("(q - k <= w && k - q <= w) || q < g || k < g"), Some((2, false, true)));
        assert_eq!(columns("k < g || (q >= k && q - k < w)"), Some((0, false, true)));
        assert_eq!(columns("q >= k || 4 >= k"), Some((1, true, false)));
        assert_eq!(columns("q < g || q >= k"), None);
        assert_eq!(columns("k < g && q >= k"), None);
        assert_eq!(columns("k > g || q >= k"), None);
    }

    #[test]
    fn past_columns_and_the_columns_split_the_mask() {
        use crate::reference::{Arith, Env, Position, Value};
        let source =
            |body: &str| format!("S {{ dtype: bf16, head_dim: 64, param w: i32, param g: i32, mask: {body} }}");
        for body in
            ["k < g || (q >= k && q - k < w)", "g >= k || (q - k < w && k - q < w)", "(q >= k && q - k < w) || k <= g"]
        {
            let spec = parse_one(&source(body)).unwrap();
            let parts = MaskParts::of(spec.mask.as_ref()).unwrap();
            let (columns, past) = parts.past_columns().unwrap();
            let shape = Shape { batch: 1, heads: 1, heads_kv: 1, q_len: 90, kv_len: 90 };
            for (w, g) in [(0, 4), (5, -3), (17, 0), (50, 33), (200, 100)] {
                let params = [ParamValue::I32(w), ParamValue::I32(g)];
                let env = Env::new(&spec, &shape, &params, &[], Arith::F64).unwrap();
                let keeps =
                    |e: &Expr, q, k| env.eval(e, &Position { b: 0, h: 0, q, k, score: 0.0 }) == Value::Bool(true);
                for (q, k) in (0..90).flat_map(|q| (0..90).map(move |k| (q, k))) {
                    let (whole, kept, rest) =
                        (keeps(spec.mask.as_ref().unwrap(), q, k), keeps(&columns.keep(), q, k), keeps(&past, q, k));
                    assert_eq!(whole, kept || rest, "{body} at w {w}, g {g}, ({q}, {k})");
                    assert!(!(kept && rest), "{body}: ({q}, {k}) in both");
                }
            }
        }
        let three = mask("(q - k <= w && k - q <= w) || q < g || k < g");
        assert!(MaskParts::of(Some(&three)).unwrap().past_columns().is_none());
        let rows = mask("q < g || (q >= k && q - k < w)");
        assert!(MaskParts::of(Some(&rows)).unwrap().past_columns().is_none());
    }

    #[test]
    fn global_rows_first_visits_every_tile_once_dense_ones_first() {
        for (bhs, q_tiles, dense) in [(1, 1, 0), (1, 1, 1), (3, 5, 0), (3, 5, 2), (4, 6, 6), (7, 3, 1)] {
            let order: Vec<(i64, i64)> =
                (0..bhs * q_tiles).map(|i| global_rows_first(i, bhs, q_tiles, dense)).collect();
            let mut seen = order.clone();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len() as i64, bhs * q_tiles);
            assert!(seen.iter().all(|&(bh, t)| (0..bhs).contains(&bh) && (0..q_tiles).contains(&t)));
            assert!(order[..(dense * bhs) as usize].iter().all(|&(_, t)| t < dense));
        }
        let bound = mask("q < g");
        let g = GlobalRows { bound: &bound, inclusive: false };
        assert_eq!([-5, 0, 1, 64, 65, 1000].map(|r| g.dense_tiles(r, 300, 64)), [0, 0, 1, 1, 2, 5]);
    }

    #[test]
    fn longest_tail_last_visits_every_tile_once_shortest_last() {
        for (bhs, q_tiles, tail) in
            [(1, 1, 0), (1, 1, 256), (3, 5, 0), (3, 5, 7), (4, 6, 256), (512, 8, 256), (37, 9, 30)]
        {
            let order: Vec<(i64, i64)> = (0..bhs * q_tiles).map(|i| longest_tail_last(i, bhs, q_tiles, tail)).collect();
            let mut seen = order.clone();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len() as i64, bhs * q_tiles);
            assert!(seen.iter().all(|&(bh, t)| (0..bhs).contains(&bh) && (0..q_tiles).contains(&t)));
            // The order ends on the tail's pairs' first tiles, one each: that
            // run counts the pairs, whose items number about `tail` (all where
            // there are fewer) and go longest (last rows) first; before them
            // each pair's tiles come together.
            let tail_pairs = order.iter().rev().take_while(|&&(_, t)| t == 0).count() as i64;
            let tail_items = (tail_pairs * q_tiles) as usize;
            if q_tiles > 1 {
                assert!(tail_items as i64 >= tail.min(bhs * q_tiles));
                assert!(tail_pairs == 1 || (tail_items as i64) < tail + q_tiles, "{tail_pairs} pairs for {tail}");
            }
            let tail_order = &order[order.len() - tail_items..];
            assert!(tail_order.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!(order[..order.len() - tail_items].windows(2).all(|w| w[0].0 <= w[1].0));
        }
    }

    #[test]
    fn global_columns_first_starts_every_cta_once_global_tiles_first() {
        for (pairs, key_tiles, global, band, tail) in [
            (1, 1, 0, 4, 0),
            (1, 1, 1, 4, 256),
            (6, 5, 0, 4, 0),
            (6, 5, 2, 4, 256),
            (9, 3, 3, 4, 8),
            (5, 7, 1, 2, 20),
            (512, 8, 0, 4, 256),
            (37, 9, 2, 4, 30),
        ] {
            let order: Vec<(i64, i64)> = (0..pairs * key_tiles)
                .map(|cta| global_columns_first(cta, pairs, key_tiles, global, band, tail))
                .collect();
            let mut seen = order.clone();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len() as i64, pairs * key_tiles);
            assert!(seen.iter().all(|&(p, t)| (0..pairs).contains(&p) && (0..key_tiles).contains(&t)));
            let (first, rest) = order.split_at((global * pairs) as usize);
            assert!(first.iter().all(|&(_, t)| t < global) && rest.iter().all(|&(_, t)| t >= global));
            // A band's CTAs take its pairs key tile by key tile; the last band
            // holds at least `band` pairs and, where there are enough, about
            // `tail` CTAs.
            assert!(rest.iter().take(band.min(pairs) as usize).all(|&(_, t)| t == global));
            if let Some(&(last_pair, _)) = rest.last() {
                let tiles = key_tiles - global;
                let tail_pairs = order.iter().rev().take_while(|&&(_, t)| t == key_tiles - 1).count() as i64;
                assert_eq!(last_pair, pairs - 1);
                assert!(tail_pairs >= band.min(pairs) && tail_pairs * tiles < tail.max(band * tiles) + band * tiles);
                assert!(tail_pairs == pairs || tail_pairs * tiles >= tail.min(pairs * tiles) - band * tiles);
            }
        }
        let bound = mask("k < g");
        let g = GlobalColumns { disjunct: 0, bound: &bound, inclusive: false };
        assert_eq!([-5, 0, 1, 128, 129, 100_000].map(|c| g.key_tiles(c, 8, 128)), [0, 0, 1, 1, 2, 8]);
        assert_eq!(GlobalColumns { inclusive: true, ..g }.key_tiles(127, 8, 128), 1);
    }

    #[test]
    fn selectors_name_the_deciding_part() {
        let e = mask("k < g || q >= k");
        let parts = MaskParts::of(Some(&e)).unwrap();
        assert_eq!([0, 1, 2, 3].map(|s| parts.deciding(s)), [None, Some(0), Some(1), None]);
        let e = mask("(q - k <= w && k - q <= w) || q < g || k < g");
        let parts = MaskParts::of(Some(&e)).unwrap();
        assert_eq!([0, 1, 2, 3].map(|s| parts.deciding(s)), [None, Some(0), None, Some(2)]);
        let e = mask("q >= k && q - k < w");
        let parts = MaskParts::of(Some(&e)).unwrap();
        assert_eq!([0, 1, 2, 3].map(|s| parts.deciding(s)), [None, Some(1), Some(0), None]);
    }
}
