//! The decode kernel's decisions, made on the host before a line is
//! printed: rows per tile from the query rows sharing a K/V head, pipeline
//! stages from the target's shared memory, and the split count from the
//! launch's CTAs and the SM count. Pure functions of shapes and a
//! [`Target`], so they are unit-tested without a GPU.

use crate::cuda::target::{pad16, Target};
use crate::spec::Spec;

/// Where the kernel's K/V rows live: the one thing a paged decode kernel
/// prints differently (its lengths, row addressing and tile copies).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeCache {
    /// `[batch, max_kv_len, heads_kv, d]`, rows through `KvRows`.
    Dense,
    /// Pages through a block table, rows through `PagedKvRows`.
    Paged,
}

/// What keys a compiled decode kernel besides its spec: rows per tile,
/// pipeline depth, how the warps share a tile, the cache's element format
/// and where V's rows are. Shapes, lengths and the split count are
/// arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeConfig {
    /// 16-row MMA tiles per CTA; every warp multiplies all of them.
    pub m_tiles: u32,
    /// K/V tiles in flight (`cp.async` groups), at least 2.
    pub stages: u32,
    /// CTAs the kernel is bounded to fit per SM (`__launch_bounds__`).
    pub ctas_per_sm: u32,
    /// The K/V cache's element format.
    pub kv: KvCacheDtype,
    /// What each warp owns of a K/V tile: its keys, or its columns of O.
    pub warps: WarpSplit,
    /// V is K's first `head_dims.v` columns (MLA's absorbed cache: V a view
    /// of K with K's strides): V's fragments come from K's tiles, so each
    /// cache byte is copied once and a stage holds K alone.
    pub v_in_k: bool,
}

/// How a decode CTA's four warps share each K/V tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WarpSplit {
    /// Each warp takes a quarter of the tile's keys for S and P·V, with its
    /// own max, sum and all of O's columns; the epilogue merges the four.
    /// Where O fits a warp's registers (V head dims up to 256).
    Keys,
    /// Each warp computes S for a quarter of the tile's keys; the rows' max
    /// is shared through shared memory, so P (written there too) is one
    /// softmax, and each warp multiplies all of P by its quarter of V's
    /// columns: O's accumulators are split four ways (MLA's V head dim 512).
    Columns,
}

/// Why no decode configuration exists for a spec on a target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeUnfit {
    /// A head dim past [`MAX_DECODE_HEAD_DIM`](crate::spec::MAX_DECODE_HEAD_DIM).
    HeadDim { qk: u32, v: u32 },
    /// Not even two stages fit an SM's shared memory.
    SharedMemory { qk: u32, v: u32, v_in_k: bool },
    /// V read from K's tiles needs V's head dim at most K's, and 16-bit caches.
    VInK { qk: u32, v: u32, kv: KvCacheDtype },
    /// V head dims past 256 (warps split O's columns) take a 16-bit cache
    /// and a multiple of 256 (each warp's columns a multiple of 64, and so
    /// K's where V is read from its tiles).
    Columns { v: u32, kv: KvCacheDtype },
}

impl std::fmt::Display for DecodeUnfit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            DecodeUnfit::HeadDim { qk, v } => {
                write!(f, "head dims {qk}/{v}: decode kernels take head dims up to {}", crate::spec::MAX_DECODE_HEAD_DIM)
            }
            DecodeUnfit::SharedMemory { qk, v, v_in_k: false } if v <= qk => write!(
                f,
                "head dims {qk}/{v} leave no room for two K/V stages; if V is K's first {v} columns \
                 (MLA), plan with `v_in_k` and pass V as a view of K"
            ),
            DecodeUnfit::SharedMemory { qk, v, .. } => write!(f, "head dims {qk}/{v} leave no room for two K/V stages"),
            DecodeUnfit::VInK { qk, v, kv } => write!(
                f,
                "V read from K's tiles needs V's head dim at most K's and a 16-bit cache (head dims {qk}/{v}, {} cache)",
                kv.name()
            ),
            DecodeUnfit::Columns { v, kv } => write!(
                f,
                "V head dims past {MAX_WARP_DV} decode on 16-bit caches in multiples of 256, read from K's tiles where K's \
                 is a multiple of 64 (V head dim {v}, {} cache)",
                kv.name()
            ),
        }
    }
}

/// The element format of a decode kernel's K/V cache; Q and O are always
/// the spec's dtype.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvCacheDtype {
    /// The spec's dtype (bf16 or f16).
    #[default]
    Spec,
    /// FP8 e4m3 (a byte an element, no infinities, ±448 at most), read
    /// through f32 descale factors per tensor or per K/V head: the cache's
    /// value is `descale · e4m3`.
    E4m3,
}

impl KvCacheDtype {
    /// Bytes per cache element.
    pub fn bytes(self) -> u32 {
        match self {
            KvCacheDtype::Spec => 2,
            KvCacheDtype::E4m3 => 1,
        }
    }

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Spec => "16-bit (the spec's dtype)",
            KvCacheDtype::E4m3 => "e4m3",
        }
    }
}

/// Warps per decode CTA; each takes a quarter of every K/V tile's keys.
pub const DECODE_WARPS: u32 = 4;
/// Keys per K/V tile (pipeline stage) where warps split the keys: 16 per
/// warp, one k-step of P·V.
pub const DECODE_BLOCK_N: u32 = 64;
/// Keys per K/V tile where warps split O's columns: 8 per warp's S, two
/// k-steps of every warp's P·V. Half the key-split tile, so a stage of
/// 576-column K rows (36 KiB) leaves room for three stages on sm_80.
pub const DECODE_COLUMNS_BLOCK_N: u32 = 32;
/// The widest padded V head dim whose O fits one warp's registers.
const MAX_WARP_DV: u32 = 256;
/// The most splits a launch divides a sequence's keys among.
pub const MAX_SPLITS: u32 = 128;
/// Splits' loads the combine keeps in flight per row chunk: a round trip to
/// L2 reads that many splits' chunks.
pub const COMBINE_IN_FLIGHT: u32 = 16;

/// The round trips to L2 of a combine of `splits` splits over a row tile
/// of `rows` rows of `dv` columns: each thread weighs its 16-byte row
/// chunks (`dv / 4` a row where `dv` allows, else `dv`) one after another,
/// [`COMBINE_IN_FLIGHT`] splits' loads a round.
pub fn combine_rounds(splits: u32, rows: u32, dv: u32) -> u32 {
    let chunks = if dv.is_multiple_of(4) { dv / 4 } else { dv };
    let items = (rows * chunks).div_ceil(32 * DECODE_WARPS).max(1);
    items * splits.div_ceil(COMBINE_IN_FLIGHT)
}

/// Tiles a split gets at least: fewer would spend more on the combine and
/// the CTA's fixed costs than the parallelism gains.
const MIN_TILES_PER_SPLIT: u32 = 2;
/// The deepest pipeline considered: past it the stages only cost occupancy.
const MAX_STAGES: u32 = 4;
/// The most CTAs per SM the configuration aims for.
const MAX_CTAS_PER_SM: u32 = 4;
/// Static shared memory a decode kernel may declare beside its dynamic
/// tiles, bytes (a window's kept band, the e4m3 Q conversion's warp
/// maxima): counted when CTAs per SM are planned, so that they all fit (at
/// d = 96 three CTAs' tiles fill Hopper's 228 KiB to the byte).
const STATIC_SMEM_BYTES: u32 = 64;

impl DecodeConfig {
    /// Query rows per tile.
    pub fn block_m(self) -> u32 {
        16 * self.m_tiles
    }

    /// Keys per K/V tile.
    pub fn block_n(self) -> u32 {
        match self.warps {
            WarpSplit::Keys => DECODE_BLOCK_N,
            WarpSplit::Columns => DECODE_COLUMNS_BLOCK_N,
        }
    }

    /// The configuration for `rows` query rows per K/V head
    /// (`heads / heads_kv · q_len`) of `spec` on `target` over a 16-bit
    /// cache with V in a tensor of its own; `None` where none fits
    /// ([`DecodeConfig::choose`] says why).
    pub fn for_rows(spec: &Spec, target: Target, rows: u32) -> Option<DecodeConfig> {
        DecodeConfig::for_cache(spec, target, rows, KvCacheDtype::Spec)
    }

    /// [`DecodeConfig::for_rows`] over a cache of `kv` elements: an e4m3
    /// cache's stages are half the bytes, so more of them fit.
    pub fn for_cache(spec: &Spec, target: Target, rows: u32, kv: KvCacheDtype) -> Option<DecodeConfig> {
        DecodeConfig::choose(spec, target, rows, kv, false).ok()
    }

    /// The configuration for `rows` query rows per K/V head of `spec` on
    /// `target`, over a cache of `kv` elements, V read from K's tiles where
    /// `v_in_k`. Warps split the keys where O fits a warp's registers, else
    /// O's columns. Then as many 16-row tiles as the rows need, at most what
    /// the accumulators leave registers for (two where both head dims are at
    /// most 128, or the columns are split and V read from K's tiles; else
    /// one) and fewer where the Q tile leaves no room for two stages; then
    /// the stages and CTAs per SM (as many as shared memory and registers
    /// allow) that keep the most K/V bytes in flight per SM (each CTA
    /// `stages − 1` tiles; ties: more CTAs, whose barriers then overlap).
    pub fn choose(
        spec: &Spec,
        target: Target,
        rows: u32,
        kv: KvCacheDtype,
        v_in_k: bool,
    ) -> Result<DecodeConfig, DecodeUnfit> {
        let (qk, v) = (spec.head_dims.qk, spec.head_dims.v);
        if qk.max(v) > crate::spec::MAX_DECODE_HEAD_DIM {
            return Err(DecodeUnfit::HeadDim { qk, v });
        }
        if v_in_k && (v > qk || kv != KvCacheDtype::Spec) {
            return Err(DecodeUnfit::VInK { qk, v, kv });
        }
        let warps = if pad16(v) <= MAX_WARP_DV { WarpSplit::Keys } else { WarpSplit::Columns };
        // A warp's columns start on a 64-column swizzle period of V's tile.
        let v_cols = if v_in_k { pad16(qk) } else { pad16(v) };
        let aligned = pad16(v).is_multiple_of(64 * DECODE_WARPS) && v_cols.is_multiple_of(64);
        if warps == WarpSplit::Columns && (kv != KvCacheDtype::Spec || !aligned) {
            return Err(DecodeUnfit::Columns { v, kv });
        }
        // Two row tiles where O's accumulators leave the registers for them:
        // both head dims at most 128, or O's columns split and V read from
        // K's tiles (V's own tile copies would spill a second row tile).
        let narrow = pad16(qk.max(v)) <= 128 || (warps == WarpSplit::Columns && v_in_k);
        let most = rows.div_ceil(16).clamp(1, if narrow { 2 } else { 1 });
        let per_sm = |m_tiles: u32, stages: u32| {
            let config = DecodeConfig { m_tiles, stages, ctas_per_sm: 1, kv, warps, v_in_k };
            let per_cta = config.cta_smem_bytes(spec, target);
            let by_registers = target.regs_per_sm / (32 * DECODE_WARPS * config.registers(spec));
            (target.smem_per_sm / per_cta).min(by_registers).min(MAX_CTAS_PER_SM)
        };
        (1..=most)
            .rev()
            .find_map(|m_tiles| {
                let (stages, ctas) = (2..=MAX_STAGES)
                    .map(|s| (s, per_sm(m_tiles, s)))
                    .filter(|&(_, ctas)| ctas > 0)
                    .max_by_key(|&(s, ctas)| ((s - 1) * ctas, ctas))?;
                Some(DecodeConfig { m_tiles, stages, ctas_per_sm: ctas, kv, warps, v_in_k })
            })
            .ok_or(DecodeUnfit::SharedMemory { qk, v, v_in_k })
    }

    /// Registers a thread needs, about: O's accumulators (`m_tiles` row
    /// tiles of the warp's columns) and 96 more (S, fragments, addresses,
    /// the softmax's state), from ptxas's counts: two row tiles of d = 128
    /// take more than the 168 three CTAs leave (and spill there), one row
    /// tile of d = 64 fits the 128 of four.
    pub(super) fn registers(self, spec: &Spec) -> u32 {
        let warp_dv = match self.warps {
            WarpSplit::Keys => pad16(spec.head_dims.v),
            WarpSplit::Columns => pad16(spec.head_dims.v) / DECODE_WARPS,
        };
        self.m_tiles * warp_dv / 2 + 96
    }

    /// Dynamic shared memory, bytes: the Q tile, then the scratch
    /// ([`DecodeConfig::scratch_bytes`]); then, where warps split O's
    /// columns, the tile's P and the warps' row maxima.
    pub fn smem_bytes(self, spec: &Spec) -> u32 {
        let q = self.block_m() * pad16(spec.head_dims.qk) * 2;
        q + self.scratch_bytes(spec) + self.shared_p_bytes()
    }

    /// The shared memory a resident CTA takes on `target`, bytes: the
    /// dynamic tiles, the static declarations and the driver's reserve.
    fn cta_smem_bytes(self, spec: &Spec, target: Target) -> u32 {
        self.smem_bytes(spec) + STATIC_SMEM_BYTES + target.smem_reserved_per_cta
    }

    /// The shared memory past the Q tile, bytes: `stages` K and V tiles (of
    /// the cache's elements; K's alone where V is read from them), which
    /// the epilogue reuses to merge the warps' rows and a split launch's
    /// last CTA to weigh the splits: as much as the largest of the three.
    pub(super) fn scratch_bytes(self, spec: &Spec) -> u32 {
        let stages = self.stages * self.stage_bytes(spec);
        stages.max(self.merge_bytes(spec)).max(self.combine_bytes())
    }

    /// One stage's K and V tiles (K's alone where V is read from them), bytes.
    fn stage_bytes(self, spec: &Spec) -> u32 {
        let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
        let v_cols = if self.v_in_k { 0 } else { dvp };
        self.block_n() * (dp + v_cols) * self.kv.bytes()
    }

    /// The split combine's weights (a row's LSE-derived factor per split),
    /// f32 [BLOCK_M][MAX_SPLITS], bytes.
    fn combine_bytes(self) -> u32 {
        4 * self.block_m() * MAX_SPLITS
    }

    /// The epilogue's f32 rows of O (a slice per warp, or one where warps
    /// split the columns) and per-warp maxima and sums, bytes.
    pub(super) fn merge_bytes(self, spec: &Spec) -> u32 {
        let rows = self.block_m();
        4 * (self.merge_slices() * rows * pad16(spec.head_dims.v) + 2 * DECODE_WARPS * rows + 2 * rows)
    }

    /// The epilogue's slices of O: each warp's own where every warp holds
    /// every column (summed as the rows leave), one shared where each holds
    /// its own columns.
    pub(super) fn merge_slices(self) -> u32 {
        match self.warps {
            WarpSplit::Keys => DECODE_WARPS,
            WarpSplit::Columns => 1,
        }
    }

    /// Where warps split O's columns: the tile's P (16-bit) and each warp's
    /// row maxima (f32), bytes; else none.
    fn shared_p_bytes(self) -> u32 {
        match self.warps {
            WarpSplit::Keys => 0,
            WarpSplit::Columns => self.block_m() * self.block_n() * 2 + DECODE_WARPS * self.block_m() * 4,
        }
    }

    /// The most splits worth a launch over `kv_tiles` tiles of keys: each
    /// split keeps a few tiles (the combine's cost is [`split_count`]'s).
    pub fn max_splits(kv_tiles: u32) -> u32 {
        (kv_tiles / MIN_TILES_PER_SPLIT).clamp(1, MAX_SPLITS)
    }

    /// The split count for an unsplit launch of `ctas` CTAs with `rows`
    /// query rows per K/V head over `kv_tiles` tiles of keys on `sms` SMs
    /// ([`split_count`], bounded by [`DecodeConfig::max_splits`]).
    pub fn splits(self, spec: &Spec, cache: DecodeCache, rows: u32, kv_tiles: u32, ctas: u64, sms: u32) -> u32 {
        let in_flight = f64::from((self.stages - 1) * self.stage_bytes(spec));
        let paged = if cache == DecodeCache::Paged { PAGED_CTAS } else { 1.0 };
        let saturating_ctas = SM_BYTES_IN_FLIGHT / in_flight * paged;
        let launch = SplitLaunch { ctas, sms, ctas_per_sm: self.ctas_per_sm, saturating_ctas, kv_tiles };
        let tile_rows = rows.clamp(1, self.block_m());
        let combine = |s: u32| f64::from(combine_rounds(s, tile_rows, spec.head_dims.v)) * COMBINE_ROUND_TILES;
        split_count(launch, Self::max_splits(kv_tiles), combine)
    }
}

/// An unsplit decode launch: `ctas` CTAs (row tiles × K/V heads × batch)
/// over `kv_tiles` tiles of keys, on `sms` SMs of `ctas_per_sm` CTAs each.
#[derive(Clone, Copy, Debug)]
pub struct SplitLaunch {
    pub ctas: u64,
    pub sms: u32,
    pub ctas_per_sm: u32,
    /// The CTAs an SM needs at once to stream at its share of the GPU's
    /// bandwidth: [`SM_BYTES_IN_FLIGHT`] over a CTA's tiles in flight.
    pub saturating_ctas: f64,
    pub kv_tiles: u32,
}

/// The bytes an SM keeps in flight to stream at its share of the GPU's
/// bandwidth (Little's law: about 33 GB/s an SM on an H200 times a copy's
/// latency): a split count that adds CTAs to SMs already streaming at that
/// rate only divides it among them (bf16 at d = 128: one CTA's two 32 KiB
/// tiles), where SMs of e4m3 CTAs (three 16 KiB tiles each) need two.
const SM_BYTES_IN_FLIGHT: f64 = 64.0 * 1024.0;
/// How many times the CTAs an SM needs to stream a paged cache at its rate: a
/// paged copy first reads the block table and passes pages by shuffle (16
/// sequences of 16k keys on pages of 16: one CTA an SM read 3,178 GB/s on
/// an H200, two 4,115).
const PAGED_CTAS: f64 = 2.0;

/// A decode CTA's fixed cost in tiles' time: its first tile's latency, the
/// merge of its warps' rows and the split's rows written for the combine.
const CTA_TILES: u32 = 1;

/// How much sooner than fewer splits more must finish, by the model, to be
/// chosen: splits cost what it leaves out (more prologues, their rows
/// written and read back), so fewer win a near-tie (16 sequences of 64k
/// keys: one split read 4,598 GB/s on an H200, the 41 that the model saw
/// finish 0.4% sooner would have read ~4,400).
const SPLIT_MARGIN: f64 = 0.03;

/// A combine's round trip to L2 in tiles' time (a split streams its tiles
/// at a CTA's share of the SM's bandwidth, the combine waits on L2's
/// latency): fitted on an H200 to MLA's split counts that ran fastest at
/// batch 1 (16 and 128 heads, 4k to 64k keys), where the combine weighs
/// most (a bf16 or e4m3 row tile at d = 128 is one row chunk a thread).
const COMBINE_ROUND_TILES: f64 = 0.4;

/// How many CTAs each sequence's keys are split among in `launch`, at most
/// `most`: 1 where the unsplit launch's waves are at least 80% full; else
/// the fewest splits that finish within [`SPLIT_MARGIN`] of the soonest.
/// A launch's time, in the time an SM streams a tile at its full rate: the
/// waves its CTAs fill, each the tiles its SMs' CTAs stream (at the SM's
/// full rate once they keep [`SplitLaunch::saturating_ctas`] CTAs' tiles in
/// flight, slower with fewer) plus [`CTA_TILES`], then the combine,
/// `combine(s)` for `s` splits (the last CTA's reads of the splits' rows, [`combine_rounds`]:
/// MLA's 512-column rows make many splits cost more than they save). The
/// kernel hands a split `ceil(kv_tiles / s)` tiles, so `s` splits keep
/// only `ceil(kv_tiles / that)` CTAs busy (31 splits of 64 tiles: 22 CTAs
/// of three tiles, not 31 of two). A second CTA on an SM that one CTA
/// already keeps streaming at full rate only halves each one's rate: at
/// batch 16, 4k keys, 128 CTAs of one split each read 3,532 GB/s on an
/// H200 where 256 of two splits read 3,462.
pub fn split_count(launch: SplitLaunch, most: u32, combine: impl Fn(u32) -> f64) -> u32 {
    let wave = u64::from(launch.sms.max(1)) * u64::from(launch.ctas_per_sm.max(1));
    let (ctas, tiles) = (launch.ctas.max(1), launch.kv_tiles.max(1));
    if ctas as f64 / (ctas.div_ceil(wave) * wave) as f64 >= 0.8 {
        return 1;
    }
    let sms = u64::from(launch.sms.max(1));
    let time = |s: u32| {
        let per_split = tiles.div_ceil(s);
        let busy = ctas.saturating_mul(u64::from(tiles.div_ceil(per_split)));
        // The CTAs an SM holds at once, and at what share of its full rate
        // their tiles stream.
        let per_sm = busy.div_ceil(sms).clamp(1, u64::from(launch.ctas_per_sm.max(1)));
        let rate = (per_sm as f64 / launch.saturating_ctas).min(1.0);
        let wave = per_sm as f64 * f64::from(per_split) / rate + f64::from(CTA_TILES);
        let combined = if s > 1 { combine(s) } else { 0.0 };
        busy.div_ceil(sms * per_sm) as f64 * wave + combined
    };
    let most = most.clamp(1, MAX_SPLITS);
    let soonest = (1..=most).map(time).fold(f64::INFINITY, f64::min);
    (1..=most).find(|&s| time(s) <= soonest * (1.0 + SPLIT_MARGIN)).unwrap_or(1)
}

/// The split counts a tuner times for keys of `kv_tiles` tiles: powers of
/// two up to one tile a split (and [`MAX_SPLITS`]), and `chosen`, the
/// plan's own count; ascending, each once. The best count moves between
/// GPUs by more than [`split_count`]'s model of waves sees, mostly at
/// batch 1, where splits are all the parallelism there is.
pub fn split_candidates(chosen: u32, kv_tiles: u32) -> Vec<u32> {
    let most = kv_tiles.clamp(1, MAX_SPLITS);
    let mut counts: Vec<u32> = std::iter::successors(Some(1u32), |&s| Some(s * 2)).take_while(|&s| s <= most).collect();
    counts.push(chosen.clamp(1, MAX_SPLITS));
    counts.sort_unstable();
    counts.dedup();
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(d: u32) -> Spec {
        crate::parse_one(&format!("S {{ dtype: bf16, head_dim: {d} }}")).unwrap()
    }

    #[test]
    fn tile_rows_follow_the_query_group() {
        let h = Target::HOPPER;
        // GQA ratio × q_len: MHA and MQA-like groups, d = 128.
        for (rows, m_tiles) in [(1, 1), (4, 1), (8, 1), (16, 1), (17, 2), (32, 2), (64, 2), (128, 2)] {
            assert_eq!(DecodeConfig::for_rows(&spec(128), h, rows).unwrap().m_tiles, m_tiles, "{rows} rows");
        }
        // d = 256: O's registers allow one 16-row tile.
        assert_eq!(DecodeConfig::for_rows(&spec(256), h, 64).unwrap().m_tiles, 1);
    }

    #[test]
    fn stages_fill_shared_memory() {
        let h = Target::HOPPER;
        let c = DecodeConfig::for_rows(&spec(128), h, 4).unwrap();
        assert_eq!((c.stages, c.ctas_per_sm), (3, 2), "two CTAs of three 32 KiB stages");
        let c = DecodeConfig::for_rows(&spec(256), h, 4).unwrap();
        assert_eq!((c.stages, c.ctas_per_sm), (3, 1));
        let c = DecodeConfig::for_rows(&spec(64), h, 4).unwrap();
        assert_eq!((c.stages, c.ctas_per_sm), (4, 3), "nine 16 KiB tiles in flight");
        for d in [64, 96, 128, 256] {
            for target in [h, Target::PORTABLE, Target::for_sm(8, 6)] {
                for kv in [KvCacheDtype::Spec, KvCacheDtype::E4m3] {
                    let Some(c) = DecodeConfig::for_cache(&spec(d), target, 32, kv) else {
                        assert!(d == 256 && target.smem_per_sm < 128 * 1024, "d = {d} fits {target:?}");
                        continue;
                    };
                    let per_cta = c.cta_smem_bytes(&spec(d), target);
                    assert!(c.stages >= 2 && c.ctas_per_sm * per_cta <= target.smem_per_sm, "d = {d}: {c:?}");
                }
            }
        }
    }

    #[test]
    fn registers_bound_the_ctas() {
        let h = Target::HOPPER;
        // Two row tiles of an e4m3 cache at d = 128: shared memory would
        // take three CTAs, whose 168 registers a thread spilled O.
        let c = DecodeConfig::for_cache(&spec(128), h, 32, KvCacheDtype::E4m3).unwrap();
        assert_eq!((c.m_tiles, c.ctas_per_sm), (2, 2));
        // V read from K's tiles at d = 128: the same.
        let c = DecodeConfig::choose(&spec(128), h, 32, KvCacheDtype::Spec, true).unwrap();
        assert_eq!((c.m_tiles, c.ctas_per_sm), (2, 2));
        // One row tile at d = 64 fits four CTAs' 128 registers.
        let c = DecodeConfig::for_cache(&spec(64), h, 4, KvCacheDtype::E4m3).unwrap();
        assert_eq!(c.ctas_per_sm, 4);
        for d in [64, 128, 256] {
            for rows in [4, 32] {
                let c = DecodeConfig::for_rows(&spec(d), h, rows).unwrap();
                assert!(c.ctas_per_sm * 128 * c.registers(&spec(d)) <= h.regs_per_sm, "d = {d}: {c:?}");
            }
        }
    }

    #[test]
    fn e4m3_stages_are_half_the_bytes() {
        let h = Target::HOPPER;
        let c = DecodeConfig::for_cache(&spec(128), h, 4, KvCacheDtype::E4m3).unwrap();
        assert_eq!(c.smem_bytes(&spec(128)), 16 * 128 * 2 + c.stages * 64 * 256);
        assert_eq!((c.stages, c.ctas_per_sm), (4, 3), "nine 16 KiB tiles in flight, as bf16 at d = 64");
        assert_eq!(DecodeConfig::for_rows(&spec(128), h, 4).unwrap().kv, KvCacheDtype::Spec);
    }

    fn mla() -> Spec {
        crate::parse_one("Mla { dtype: bf16, head_dim: 576, v_head_dim: 512 }").unwrap()
    }

    #[test]
    fn mla_splits_o_columns_and_reads_v_from_k() {
        let h = Target::HOPPER;
        // 16 and 128 query heads, q_len 1 and 4: two 16-row tiles at most.
        for (rows, m_tiles) in [(16, 1), (64, 2), (128, 2), (512, 2)] {
            let c = DecodeConfig::choose(&mla(), h, rows, KvCacheDtype::Spec, true).unwrap();
            assert_eq!((c.m_tiles, c.warps, c.block_n()), (m_tiles, WarpSplit::Columns, 32), "{rows} rows");
        }
        let c = DecodeConfig::choose(&mla(), h, 64, KvCacheDtype::Spec, true).unwrap();
        assert_eq!((c.stages, c.ctas_per_sm), (4, 1), "three 36 KiB K tiles in flight");
        // K's tile alone per stage (V is its first 512 columns), then P and the maxima.
        assert_eq!(c.smem_bytes(&mla()), 32 * 576 * 2 + 4 * 32 * 576 * 2 + 32 * 32 * 2 + 4 * 32 * 4);
        assert!(c.merge_bytes(&mla()) <= 4 * 32 * 576 * 2);
        // sm_80 (164 KiB): three stages beside two row tiles; sm_86 (100
        // KiB): two stages beside one.
        let c = DecodeConfig::choose(&mla(), Target::PORTABLE, 64, KvCacheDtype::Spec, true).unwrap();
        assert_eq!((c.m_tiles, c.stages), (2, 3));
        let c = DecodeConfig::choose(&mla(), Target::for_sm(8, 6), 64, KvCacheDtype::Spec, true).unwrap();
        assert_eq!((c.m_tiles, c.stages), (1, 2));
        for target in [h, Target::PORTABLE, Target::for_sm(8, 6)] {
            let c = DecodeConfig::choose(&mla(), target, 128, KvCacheDtype::Spec, true).unwrap();
            assert!(c.smem_bytes(&mla()) + target.smem_reserved_per_cta <= target.smem_per_sm, "{target:?}");
        }
    }

    #[test]
    fn mla_refusals_are_typed() {
        let h = Target::HOPPER;
        let bits16 = KvCacheDtype::Spec;
        // V in a tensor of its own: stages of 36 KiB of K and 32 of V fit
        // Hopper three times, sm_80 twice, not sm_86.
        let c = DecodeConfig::choose(&mla(), h, 128, bits16, false).unwrap();
        assert_eq!((c.warps, c.v_in_k, c.m_tiles, c.stages), (WarpSplit::Columns, false, 1, 3));
        let c = DecodeConfig::choose(&mla(), Target::PORTABLE, 16, bits16, false).unwrap();
        assert_eq!(c.stages, 2);
        let sm86 = DecodeConfig::choose(&mla(), Target::for_sm(8, 6), 16, bits16, false).unwrap_err();
        assert!(matches!(sm86, DecodeUnfit::SharedMemory { qk: 576, v: 512, v_in_k: false }), "{sm86}");
        assert!(sm86.to_string().contains("v_in_k"), "{sm86}");
        let e4m3 = DecodeConfig::choose(&mla(), h, 16, KvCacheDtype::E4m3, false).unwrap_err();
        assert!(matches!(e4m3, DecodeUnfit::Columns { v: 512, .. }), "{e4m3}");
        let e4m3_in_k = DecodeConfig::choose(&mla(), h, 16, KvCacheDtype::E4m3, true).unwrap_err();
        assert!(matches!(e4m3_in_k, DecodeUnfit::VInK { .. }), "{e4m3_in_k}");
        let wide_v = crate::parse_one("W { dtype: bf16, head_dim: 128, v_head_dim: 512 }").unwrap();
        let err = DecodeConfig::choose(&wide_v, h, 16, bits16, true).unwrap_err();
        assert!(matches!(err, DecodeUnfit::VInK { qk: 128, v: 512, .. }), "{err}");
        let odd = crate::parse_one("O { dtype: bf16, head_dim: 576, v_head_dim: 320 }").unwrap();
        assert!(matches!(DecodeConfig::choose(&odd, h, 16, bits16, true), Err(DecodeUnfit::Columns { v: 320, .. })));
        // Below 256, V in K keeps the key split and frees V's stages.
        let c = DecodeConfig::choose(&spec(256), h, 16, bits16, true).unwrap();
        assert_eq!((c.warps, c.block_n(), c.stages, c.ctas_per_sm), (WarpSplit::Keys, 64, 3, 2));
    }

    #[test]
    fn splits_fill_the_gpu() {
        // H100/H200: 132 SMs, two CTAs each, one CTA's two 32 KiB tiles in
        // flight keep an SM streaming; 8 K/V heads, q_len 1.
        let config = DecodeConfig::for_rows(&spec(128), Target::HOPPER, 4).unwrap();
        let tiles = |kv_len: u32| kv_len.div_ceil(DECODE_BLOCK_N);
        let split =
            |batch: u64, kv_len: u32| config.splits(&spec(128), DecodeCache::Dense, 4, tiles(kv_len), batch * 8, 132);
        assert_eq!(split(1, 65536), 16, "128 CTAs, one an SM: a second would halve each one's rate");
        let paged =
            |batch: u64, kv_len: u32| config.splits(&spec(128), DecodeCache::Paged, 4, tiles(kv_len), batch * 8, 132);
        assert_eq!((paged(1, 65536), paged(16, 16384)), (32, 2), "paged copies stream at two CTAs an SM");
        assert_eq!(split(1, 4096), 16, "four tiles each");
        assert_eq!(split(1, 1024), 8, "16 tiles: splits keep 2 at least");
        assert_eq!(split(1, 64), 1, "one tile is never split");
        assert_eq!(split(16, 65536), 1, "128 CTAs: every SM but four streams");
        assert_eq!(split(64, 4096), 1, "512 CTAs: no split");
        assert_eq!(split(256, 1024), 1);
        // Three CTAs an SM, two needed to stream (e4m3 stages), 64 tiles:
        // 512 CTAs would leave a second wave 30% full; three splits of 22
        // tiles fill 97% of four waves.
        let launch = |ctas, ctas_per_sm, saturating_ctas| SplitLaunch {
            ctas,
            sms: 132,
            ctas_per_sm,
            saturating_ctas,
            kv_tiles: 64,
        };
        let combine = |s: u32| 0.1 * f64::from(s);
        assert_eq!(split_count(launch(64 * 8, 3, 1.5), 32, combine), 3, "1536 of 1584 slots");
        assert_eq!(split_count(launch(16 * 8, 3, 1.5), 32, combine), 2, "one CTA an SM streams at 2/3 of the rate");
        assert_eq!(
            split_count(launch(40 * 8, 2, 1.0), 128, combine),
            4,
            "320 CTAs would leave a 21% second wave: 1280 of 1320"
        );
        let huge = SplitLaunch { ctas: 1, sms: 10_000, ctas_per_sm: 4, saturating_ctas: 1.0, kv_tiles: u32::MAX };
        assert!(split_count(huge, u32::MAX, |_| 0.0) <= MAX_SPLITS);
        let nothing = SplitLaunch { ctas: 0, sms: 0, ctas_per_sm: 0, saturating_ctas: 0.0, kv_tiles: 0 };
        assert_eq!(split_count(nothing, 0, |_| 0.0), 1, "degenerate inputs still give one split");
    }

    #[test]
    fn combine_rounds_follow_the_chunks_and_splits() {
        // bf16, d = 128, four rows (GQA 4): one chunk a thread.
        assert_eq!(combine_rounds(COMBINE_IN_FLIGHT, 4, 128), 1);
        assert_eq!(combine_rounds(COMBINE_IN_FLIGHT + 1, 4, 128), 2, "a second round for one split");
        // MLA: 16 rows of 512 columns, 16 chunks a thread; odd dims, a column a chunk.
        assert_eq!(combine_rounds(COMBINE_IN_FLIGHT, 16, 512), 16);
        assert_eq!(combine_rounds(2, 16, 59), 8);
    }

    #[test]
    fn tuners_time_powers_of_two_and_the_plans_count() {
        assert_eq!(split_candidates(31, 64), [1, 2, 4, 8, 16, 31, 32, 64]);
        assert_eq!(split_candidates(2, 3), [1, 2], "no split without a tile of keys");
        assert_eq!(split_candidates(1, 0), [1]);
        assert_eq!(split_candidates(1, u32::MAX).last(), Some(&MAX_SPLITS));
        assert_eq!(split_candidates(u32::MAX, 4), [1, 2, 4, MAX_SPLITS], "a forced count is timed as given");
    }

    #[test]
    fn the_combine_weighs_mla_splits() {
        let h = Target::HOPPER;
        // 16 heads, one row tile of 16 rows (16 chunks a combining thread)
        // over 4k, 16k and 64k keys of 32-key tiles.
        let c = DecodeConfig::choose(&mla(), h, 16, KvCacheDtype::Spec, true).unwrap();
        assert_eq!(
            c.splits(&mla(), DecodeCache::Dense, 16, 128, 1, 132),
            16,
            "8 tiles each: a second round of the combine costs more"
        );
        assert_eq!(c.splits(&mla(), DecodeCache::Dense, 16, 512, 1, 132), 32);
        assert_eq!(c.splits(&mla(), DecodeCache::Dense, 16, 2048, 1, 132), 63, "33 tiles each: within 3% of 64's 32");
        // 128 heads: four row tiles of 32 (32 chunks a combining thread).
        let c = DecodeConfig::choose(&mla(), h, 128, KvCacheDtype::Spec, true).unwrap();
        assert_eq!(c.splits(&mla(), DecodeCache::Dense, 128, 128, 4, 132), 16);
        assert_eq!(
            c.splits(&mla(), DecodeCache::Dense, 128, 512, 4, 132),
            31,
            "124 of 132 SMs, 17 tiles each: within 3% of 32's 16"
        );
        assert_eq!(
            c.splits(&mla(), DecodeCache::Dense, 128, 2048, 64, 132),
            2,
            "16 sequences: 128 CTAs, a combine of two"
        );
    }
}
