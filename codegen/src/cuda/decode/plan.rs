//! The decode kernel's decisions, made on the host before a line is
//! printed: rows per tile from the query rows sharing a K/V head, pipeline
//! stages from the target's shared memory, and the split count from the
//! launch's CTAs and the SM count. Pure functions of shapes and a
//! [`Target`], so they are unit-tested without a GPU.

use crate::cuda::target::{pad16, Target};
use crate::spec::Spec;

/// What keys a compiled decode kernel besides its spec: rows per tile,
/// pipeline depth and the cache's element format. Shapes, lengths and the
/// split count are arguments.
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
/// Keys per K/V tile (pipeline stage): 16 per warp, one k-step of P·V.
pub const DECODE_BLOCK_N: u32 = 64;
/// The most splits a launch divides a sequence's keys among.
pub const MAX_SPLITS: u32 = 128;
/// Tiles a split gets at least: fewer would spend more on the combine than
/// the parallelism gains. Short caches need the CTAs: a CTA alone on its SM
/// hides no latency, so a few short splits beat fewer long ones.
const MIN_TILES_PER_SPLIT: u32 = 2;
/// The deepest pipeline considered: past it the stages only cost occupancy.
const MAX_STAGES: u32 = 4;
/// The most CTAs per SM the configuration aims for.
const MAX_CTAS_PER_SM: u32 = 4;

impl DecodeConfig {
    /// Query rows per tile.
    pub fn block_m(self) -> u32 {
        16 * self.m_tiles
    }

    /// The configuration for `rows` query rows per K/V head
    /// (`heads / heads_kv · q_len`) of `spec` on `target`: as many 16-row
    /// tiles as the rows need, at most what O's accumulators leave
    /// registers for (two where both head dims are at most 128, else one:
    /// Q's fragments stay in registers across the tiles); then the stages and
    /// CTAs per SM that keep the most K/V tiles in flight per SM (each CTA
    /// `stages − 1` of them; ties: more CTAs, whose barriers then overlap).
    /// `None` where not even two stages fit an SM (d = 256 on GPUs with
    /// 100 KiB of shared memory per SM).
    pub fn for_rows(spec: &Spec, target: Target, rows: u32) -> Option<DecodeConfig> {
        DecodeConfig::for_cache(spec, target, rows, KvCacheDtype::Spec)
    }

    /// [`DecodeConfig::for_rows`] over a cache of `kv` elements: an e4m3
    /// cache's stages are half the bytes, so more of them fit.
    pub fn for_cache(spec: &Spec, target: Target, rows: u32, kv: KvCacheDtype) -> Option<DecodeConfig> {
        let most = if pad16(spec.head_dims.qk.max(spec.head_dims.v)) <= 128 { 2 } else { 1 };
        let m_tiles = rows.div_ceil(16).clamp(1, most);
        let fits = |stages: u32| {
            let config = DecodeConfig { m_tiles, stages, ctas_per_sm: 1, kv };
            let per_cta = config.smem_bytes(spec) + target.smem_reserved_per_cta;
            (target.smem_per_sm / per_cta).min(MAX_CTAS_PER_SM)
        };
        let (stages, ctas) = (2..=MAX_STAGES)
            .map(|s| (s, fits(s)))
            .filter(|&(_, ctas)| ctas > 0)
            .max_by_key(|&(s, ctas)| ((s - 1) * ctas, ctas))?;
        Some(DecodeConfig { m_tiles, stages, ctas_per_sm: ctas, kv })
    }

    /// Dynamic shared memory, bytes: the Q tile, then `stages` K and V
    /// tiles (of the cache's elements), which the epilogue reuses to merge the warps' rows (f32 O and
    /// per-warp row statistics) and never outgrows.
    pub fn smem_bytes(self, spec: &Spec) -> u32 {
        let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
        let q = self.block_m() * dp * 2;
        let stages = self.stages * DECODE_BLOCK_N * (dp + dvp) * self.kv.bytes();
        q + stages.max(self.merge_bytes(spec))
    }

    /// The epilogue's f32 rows of O and per-warp maxima and sums, bytes.
    pub(super) fn merge_bytes(self, spec: &Spec) -> u32 {
        let rows = self.block_m();
        4 * (rows * pad16(spec.head_dims.v) + 2 * DECODE_WARPS * rows + 2 * rows)
    }
}

/// How many CTAs each sequence's keys are split among: 1 where the
/// unsplit launch's (`ctas`: row tiles × K/V heads × batch) waves of `sms`
/// × `ctas_per_sm` resident CTAs are at least 80% full (a launch short of
/// one wave, or one whose last wave is nearly whole: more CTAs per SM, as
/// an e4m3 cache's half-size stages allow, leave a larger part of a wave
/// at its tail); else the fewest splits whose waves are within 85% as full
/// as the fullest any split count reaches (FlashAttention's heuristic),
/// each split keeping at least a few of the longest sequence's `kv_tiles`.
pub fn split_count(ctas: u64, sms: u32, ctas_per_sm: u32, kv_tiles: u32) -> u32 {
    let wave = u64::from(sms.max(1)) * u64::from(ctas_per_sm.max(1));
    let ctas = ctas.max(1);
    let efficiency = |s: u32| {
        let n = ctas * u64::from(s);
        n as f64 / (n.div_ceil(wave) * wave) as f64
    };
    if efficiency(1) >= 0.8 {
        return 1;
    }
    let most = (kv_tiles / MIN_TILES_PER_SPLIT).clamp(1, MAX_SPLITS);
    let best = (1..=most).map(efficiency).fold(0.0, f64::max);
    (1..=most).find(|&s| efficiency(s) >= 0.85 * best).unwrap_or(1)
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
        for d in [64, 128, 256] {
            for target in [h, Target::PORTABLE, Target::for_sm(8, 6)] {
                let Some(c) = DecodeConfig::for_rows(&spec(d), target, 32) else {
                    assert!(d == 256 && target.smem_per_sm < 128 * 1024, "d = {d} fits {target:?}");
                    continue;
                };
                let per_cta = c.smem_bytes(&spec(d)) + target.smem_reserved_per_cta;
                assert!(c.stages >= 2 && c.ctas_per_sm * per_cta <= target.smem_per_sm, "d = {d}: {c:?}");
                assert!(c.merge_bytes(&spec(d)) <= c.stages * DECODE_BLOCK_N * 2 * 2 * d);
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

    #[test]
    fn splits_fill_the_gpu() {
        // H100: 132 SMs, two CTAs each; 8 K/V heads, q_len 1.
        let split = |batch: u64, kv_len: u32| split_count(batch * 8, 132, 2, kv_len.div_ceil(DECODE_BLOCK_N));
        assert_eq!(split(1, 65536), 29, "8 CTAs: 232 of 264 slots is within 85% of all");
        assert_eq!(split(16, 65536), 2);
        assert_eq!(split(64, 4096), 1, "512 CTAs: no split");
        // Three CTAs an SM (e4m3 stages): 512 CTAs would leave a second wave
        // 30% full; two splits fill 86% of three.
        assert_eq!(split_count(64 * 8, 132, 3, 64), 2, "1024 of 1188 slots");
        assert_eq!(split_count(40 * 8, 132, 2, 64), 3, "320 CTAs would leave a 21% second wave: 960 of 1056");
        assert_eq!(split(256, 1024), 1);
        assert_eq!(split(1, 4096), 28, "64 tiles: 224 of 264 slots");
        assert_eq!(split(1, 1024), 7, "16 tiles: splits keep 2 at least");
        assert_eq!(split(1, 64), 1, "one tile is never split");
        assert_eq!(split_count(1, 132, 2, u32::MAX), 109, "the fewest splits within 85% of the best wave");
        assert!(split_count(1, 10_000, 4, u32::MAX) <= MAX_SPLITS);
        assert_eq!(split_count(0, 0, 0, 0), 1, "degenerate inputs still give one split");
    }
}
