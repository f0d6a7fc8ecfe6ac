//! What autotuning remembers: the shape class a launch belongs to, and one
//! small text file per tuned (pass, spec, shape class, arch, codegen
//! version) in the disk cache's `tuning/` directory.
//!
//! A record names the winning tile (a forward [`TileConfig`] or a dK/dV
//! kernel's [`BackwardTile`]: a [`Candidate`]) and the candidates it was
//! chosen from. It is used only if it is whole (ends with `end`), was
//! written for exactly its key, and was tuned among exactly today's
//! candidates: a record from before the candidate list changed, or a damaged
//! one, is deleted with a warning and the class counts as untuned. Parsing
//! never panics and trusts nothing it reads: the winner is looked up by name
//! among the current candidates, never built from the file.

use crate::arch::Arch;
use crate::atomic_file::{remove_if_present, write_atomic};
use crate::disk_cache::{DiskCache, TUNING_EXTENSION};
use crate::stable_hash::Fnv1a;
use flashgen_codegen::cuda::{BackwardTile, KeyColumns, TileConfig};
use flashgen_codegen::{Shape, Spec};
use std::ffi::OsString;
use std::fmt;
use std::io;
use std::path::PathBuf;

/// `1` (or `on`): a forward or dense backward launch whose shape class has no
/// tuned choice yet autotunes first, on its own buffers. Off by default.
pub const AUTOTUNE_ENV: &str = "FLASHGEN_AUTOTUNE";

/// Whether the value of [`AUTOTUNE_ENV`] turns tuning on launches on.
pub(crate) fn autotune_from(value: Option<OsString>) -> bool {
    value.is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("on"))
}

/// The part of a launch's shape that decides which tile configuration is
/// fastest; a tuned choice applies to every launch of its class.
///
/// Sequence lengths count by magnitude: the K/V length is the trip count of
/// each CTA's loop (how well a deep pipeline or a large tile pays off), the
/// query length how many of a CTA's rows are real and, with the heads and
/// batch, the grid. The grid counts against the GPU: a launch of
/// batch · heads · q-tiles CTAs fills some number of *waves* of the SMs,
/// and whether that is a fraction of a wave (latency-bound), about one, or
/// many (throughput-bound) is what separates, say, one large CTA per SM from
/// two smaller ones. Q-tiles are counted at the block-mask tile's rows, one
/// fixed yardstick per spec: a candidate with smaller tiles launches
/// proportionally more CTAs, which changes no class boundary's meaning. Each is bucketed by powers of two, so a handful of
/// tunings covers a model's shapes; head dims, dtype, mask and score are in
/// the spec, which keys the choice too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShapeClass {
    /// ⌈log₂ q_len⌉: queries in (2^(n−1), 2^n].
    pub q_len_log2: u8,
    /// ⌈log₂ kv_len⌉.
    pub kv_len_log2: u8,
    /// ⌈log₂(CTAs / SMs)⌉, clamped to [−4, 4]: −4 is at most 1/16 of a
    /// wave, 4 more than 8 waves.
    pub waves_log2: i8,
}

const WAVES_LOG2: (i8, i8) = (-4, 4);

impl ShapeClass {
    /// The class of a launch of `spec` at `shape` on a GPU with `sm_count` SMs.
    pub fn new(spec: &Spec, shape: &Shape, sm_count: u32) -> ShapeClass {
        let rows = TileConfig::mask_tile(spec).0.max(1) as usize;
        // Saturated at 2^64 (beyond any grid), so the shifts below fit 128 bits.
        let ctas = shape.batch.saturating_mul(shape.heads).saturating_mul(shape.q_len.div_ceil(rows)) as u128;
        let sms = u128::from(sm_count.max(1));
        // The least k with ctas ≤ sms · 2^k.
        let fits = |k: i8| if k >= 0 { ctas <= sms << k } else { ctas << -k <= sms };
        let (min, max) = WAVES_LOG2;
        ShapeClass {
            q_len_log2: ceil_log2(shape.q_len),
            kv_len_log2: ceil_log2(shape.kv_len),
            waves_log2: (min..max).find(|&k| fits(k)).unwrap_or(max),
        }
    }

    /// The most keys a launch of the class has.
    pub fn kv_len_bound(&self) -> usize {
        1usize.checked_shl(self.kv_len_log2.into()).unwrap_or(usize::MAX)
    }

    /// The most queries a launch of the class has.
    pub fn q_len_bound(&self) -> usize {
        1usize.checked_shl(self.q_len_log2.into()).unwrap_or(usize::MAX)
    }
}

/// ⌈log₂ n⌉, 0 for n ≤ 1.
fn ceil_log2(n: usize) -> u8 {
    (usize::BITS - n.saturating_sub(1).leading_zeros()) as u8
}

/// `q<=1024 kv<=4096 waves<=1/2`.
impl fmt::Display for ShapeClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = i32::from(self.waves_log2);
        write!(f, "q<={} kv<={} ", pow2(self.q_len_log2.into()), pow2(self.kv_len_log2.into()))?;
        match w {
            _ if w >= i32::from(WAVES_LOG2.1) => write!(f, "waves>{}", 1 << (WAVES_LOG2.1 - 1)),
            0.. => write!(f, "waves<={}", pow2(w.unsigned_abs())),
            _ => write!(f, "waves<=1/{}", pow2(w.unsigned_abs())),
        }
    }
}

/// 2^n in decimal while it fits 128 bits.
fn pow2(n: u32) -> String {
    1u128.checked_shl(n).map_or_else(|| format!("2^{n}"), |p| p.to_string())
}

/// A tile configuration's name in reports and tuning records, e.g.
/// `wgmma.w8.m1.n128`: MMA kind, warps, MMA tiles per warp, keys per tile.
pub fn config_name(config: TileConfig) -> String {
    let TileConfig { mma, warps, m_tiles, block_n } = config;
    format!("{}.w{warps}.m{m_tiles}.n{block_n}", format!("{mma:?}").to_lowercase())
}

/// A dK/dV tile's name in reports and tuning records, e.g.
/// `wgmma.w8.whole.m128`: MMA kind, warps, how they hold dK's and dV's
/// columns, queries per step.
pub fn backward_tile_name(tile: BackwardTile) -> String {
    let BackwardTile { mma, warps, columns, block_m } = tile;
    let columns = match columns {
        KeyColumns::Whole => "whole",
        KeyColumns::Halves => "halves",
        KeyColumns::Transposed => "transposed",
    };
    format!("{}.w{warps}.{columns}.m{block_m}", format!("{mma:?}").to_lowercase())
}

/// What a tuning record chooses among.
pub trait Candidate: Copy + PartialEq {
    /// Its name in reports and records: no whitespace, distinct among a
    /// spec's candidates.
    fn name(&self) -> String;
}

impl Candidate for TileConfig {
    fn name(&self) -> String {
        config_name(*self)
    }
}

impl Candidate for BackwardTile {
    fn name(&self) -> String {
        backward_tile_name(*self)
    }
}

/// Which launch a record tunes: the forward's tile configuration or the
/// backward's dK/dV tile (one class may have both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    Forward,
    Backward,
}

/// The name of a tuning record: a stable hash (the disk cache's) of
/// everything that decides the choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TuningKey(u128);

impl TuningKey {
    pub fn new(pass: Pass, spec_source: &str, class: ShapeClass, arch: Arch, codegen: u32) -> TuningKey {
        let mut h = Fnv1a::new();
        h.field(match pass {
            Pass::Forward => b"tuning",
            Pass::Backward => b"tuning backward",
        });
        h.field(spec_source.as_bytes());
        h.field(&[class.q_len_log2, class.kv_len_log2, class.waves_log2 as u8]);
        h.field(arch.to_string().as_bytes());
        h.write(&codegen.to_le_bytes());
        TuningKey(h.0)
    }
}

impl fmt::Display for TuningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

const MAGIC: &str = "flashgen-tuning 1";

/// One tuning record's contents.
pub(crate) struct Record<'a, C> {
    pub key: TuningKey,
    pub pass: Pass,
    pub spec: &'a Spec,
    pub class: ShapeClass,
    pub arch: Arch,
    /// Every candidate in order, with its median time (`None`: it failed).
    pub times: &'a [(C, Option<f64>)],
    pub best: C,
}

impl<C: Candidate> Record<'_, C> {
    /// The file's text. Only `key`, `candidates` and `best` are read back;
    /// the rest (which pass, spec, arch and class) informs people.
    pub fn render(&self) -> String {
        let names: Vec<String> = self.times.iter().map(|(c, _)| c.name()).collect();
        let mut text = format!(
            "{MAGIC}\nkey {}\npass {}\nspec {}\narch {}\nclass {}\ncandidates {}\nbest {}\n",
            self.key,
            match self.pass {
                Pass::Forward => "forward",
                Pass::Backward => "backward",
            },
            self.spec.name,
            self.arch,
            self.class,
            names.join(" "),
            self.best.name()
        );
        for (name, (_, ms)) in names.iter().zip(self.times) {
            text += &match ms {
                Some(ms) => format!("ms {name} {ms:.4}\n"),
                None => format!("ms {name} failed\n"),
            };
        }
        text + "end\n"
    }
}

/// The winner a record's `text` names, if the record is whole, written for
/// `key`, and tuned among exactly `candidates`; else why not.
pub(crate) fn parse<C: Candidate>(text: &str, key: TuningKey, candidates: &[C]) -> Result<C, &'static str> {
    let mut lines = text.lines();
    if lines.next() != Some(MAGIC) {
        return Err("not a flashgen tuning record of this version");
    }
    if text.lines().last() != Some("end") {
        return Err("truncated");
    }
    let field = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' '));
    if field("key") != Some(key.to_string().as_str()) {
        return Err("written for another key");
    }
    let names: Vec<String> = candidates.iter().map(Candidate::name).collect();
    if field("candidates").map(|l| l.split(' ').eq(names.iter().map(String::as_str))) != Some(true) {
        return Err("tuned among other candidates than today's");
    }
    let best = field("best").ok_or("names no winner")?;
    let at = names.iter().position(|n| n == best).ok_or("names a winner that is no candidate")?;
    Ok(candidates[at])
}

impl DiskCache {
    fn tuning_path(&self, key: TuningKey) -> PathBuf {
        self.tuning_dir().join(format!("{key}.{TUNING_EXTENSION}"))
    }

    /// The remembered winner of `key` among `candidates`: `None` when there
    /// is no usable record. A damaged or stale record is reported and
    /// deleted (a missing or unreadable one only reported), so the class is
    /// tuned afresh.
    pub(crate) fn load_tuning<C: Candidate>(&self, key: TuningKey, candidates: &[C]) -> Option<C> {
        let path = self.tuning_path(key);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                eprintln!("flashgen: warning: cannot read tuning record {}: {e}", path.display());
                return None;
            }
        };
        let parsed = std::str::from_utf8(&bytes).map_err(|_| "not UTF-8").and_then(|t| parse(t, key, candidates));
        parsed
            .map_err(|why| {
                eprintln!("flashgen: warning: ignoring tuning record {}: {why}", path.display());
                // Best effort: a later tuning overwrites it anyway.
                let _ = remove_if_present(&path);
            })
            .ok()
    }

    /// Stores a record atomically, replacing the key's previous one.
    pub(crate) fn store_tuning<C: Candidate>(&self, record: &Record<C>) -> io::Result<()> {
        write_atomic(&self.tuning_path(record.key), record.render().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::TempDir;
    use flashgen_codegen::cuda::{BackwardConfig, Target};
    use flashgen_codegen::{parse_one, CODEGEN_VERSION};

    const SM90: Arch = Arch::new(9, 0);
    const HOPPER: Target = Target::HOPPER;

    fn spec(head_dim: u32) -> Spec {
        parse_one(&format!("Causal {{ dtype: bf16, head_dim: {head_dim}, mask: q >= k }}")).unwrap()
    }

    fn shape(batch: usize, heads: usize, q_len: usize, kv_len: usize) -> Shape {
        Shape { batch, heads, heads_kv: heads, q_len, kv_len }
    }

    #[test]
    fn lengths_bucket_by_powers_of_two() {
        let class = |q, kv| ShapeClass::new(&spec(128), &shape(1, 1, q, kv), 132);
        for (n, log2) in [(0, 0), (1, 0), (2, 1), (3, 2), (64, 6), (65, 7), (1000, 10), (1024, 10), (1025, 11)] {
            assert_eq!(class(n, 1).q_len_log2, log2, "q_len {n}");
            assert_eq!(class(1, n).kv_len_log2, log2, "kv_len {n}");
        }
        assert_eq!(class(1000, 4000), class(1024, 4096));
        assert_ne!(class(1024, 4096), class(1025, 4096));
        assert_ne!(class(1024, 4096), class(4096, 1024));
        assert_eq!(ceil_log2(usize::MAX), 64);
    }

    #[test]
    fn waves_count_ctas_against_sms() {
        // d = 128: 128 query rows per CTA.
        let waves =
            |batch, heads, q_len, sms| ShapeClass::new(&spec(128), &shape(batch, heads, q_len, 64), sms).waves_log2;
        assert_eq!(waves(1, 132, 128, 132), 0, "exactly one wave");
        assert_eq!(waves(1, 133, 128, 132), 1, "a sliver into the second wave");
        assert_eq!(waves(1, 66, 128, 132), -1, "half a wave");
        assert_eq!(waves(1, 67, 128, 132), 0);
        assert_eq!(waves(2, 66, 128, 132), 0, "batch counts like heads");
        assert_eq!(waves(1, 66, 256, 132), 0, "two query tiles per head");
        assert_eq!(waves(1, 66, 129, 132), 0, "a ragged tile is a whole CTA");
        assert_eq!(waves(1, 1, 1, 132), -4, "clamped below");
        assert_eq!(waves(0, 16, 128, 132), -4, "an empty launch");
        assert_eq!(waves(8, 16, 16384, 132), 4, "clamped above");
        assert_eq!(waves(1, 4, 128, 0), 2, "no SM count is one SM");
        assert_eq!(waves(usize::MAX, usize::MAX, usize::MAX, 1), 4, "no overflow");
        // Above d = 128 a CTA has 64 rows, so the same shape is twice the CTAs.
        let wide = ShapeClass::new(&spec(256), &shape(1, 66, 128, 64), 132);
        assert_eq!(wide.waves_log2, 0);
    }

    #[test]
    fn classes_print_readably() {
        let class = |batch, q_len| ShapeClass::new(&spec(128), &shape(batch, 16, q_len, 4000), 132).to_string();
        assert_eq!(class(4, 1024), "q<=1024 kv<=4096 waves<=4");
        assert_eq!(class(1, 128), "q<=128 kv<=4096 waves<=1/8");
        assert_eq!(class(64, 4096), "q<=4096 kv<=4096 waves>8");
        let huge = ShapeClass { q_len_log2: 200, kv_len_log2: 0, waves_log2: -4 };
        assert_eq!(huge.to_string(), "q<=2^200 kv<=1 waves<=1/16");
    }

    #[test]
    fn candidate_names_are_distinct() {
        for head_dim in [32, 64, 96, 128, 192, 256] {
            for target in [Target::PORTABLE, HOPPER] {
                let names: Vec<String> =
                    crate::tile_choice::candidates(&spec(head_dim), target).into_iter().map(config_name).collect();
                let mut unique = names.clone();
                unique.sort();
                unique.dedup();
                assert_eq!(unique.len(), names.len(), "{names:?}");
                assert!(names.iter().all(|n| !n.contains(char::is_whitespace)), "{names:?}");
            }
        }
        let sync = TileConfig::default_for(&spec(128));
        assert_eq!(config_name(sync), "sync.w4.m2.n64");
    }

    #[test]
    fn backward_tile_names_are_distinct() {
        for head_dim in [32, 64, 96, 128, 192, 256] {
            for target in [Target::PORTABLE, HOPPER] {
                let names: Vec<String> =
                    BackwardConfig::tiles(&spec(head_dim), target).into_iter().map(backward_tile_name).collect();
                let mut unique = names.clone();
                unique.sort();
                unique.dedup();
                assert_eq!(unique.len(), names.len(), "{names:?}");
                assert!(names.iter().all(|n| !n.contains(char::is_whitespace)), "{names:?}");
            }
        }
        let long = BackwardConfig::tiles(&spec(64), HOPPER)[0];
        assert_eq!(backward_tile_name(long), "wgmma.w8.whole.m128");
    }

    #[test]
    fn backward_records_round_trip() {
        let tmp = TempDir::new("tuning-backward");
        let cache = DiskCache::at(&tmp.0);
        let spec = spec(64);
        let class = ShapeClass::new(&spec, &shape(4, 16, 1024, 1024), 132);
        let key = TuningKey::new(Pass::Backward, "S", class, SM90, CODEGEN_VERSION);
        let all = BackwardConfig::tiles(&spec, HOPPER);
        let times: Vec<_> = all.iter().map(|&t| (t, Some(0.5))).collect();
        let record = Record { key, pass: Pass::Backward, spec: &spec, class, arch: SM90, times: &times, best: all[1] };
        cache.store_tuning(&record).unwrap();
        assert_eq!(cache.load_tuning(key, &all), Some(all[1]));
        let text = std::fs::read_to_string(cache.tuning_path(key)).unwrap();
        assert!(text.contains("\npass backward\n") && text.contains("\nbest wgmma.w8.whole.m64\n"), "{text}");
        assert_eq!(cache.load_tuning(key, &all[..1]), None, "tuned among other tiles");
    }

    #[test]
    fn key_covers_spec_class_arch_and_codegen_version() {
        let class = ShapeClass::new(&spec(128), &shape(4, 16, 1024, 1024), 132);
        let other_class = ShapeClass { waves_log2: class.waves_log2 - 1, ..class };
        let base = TuningKey::new(Pass::Forward, "S", class, SM90, 1);
        assert_eq!(base, TuningKey::new(Pass::Forward, "S", class, SM90, 1), "stable");
        assert_eq!(base.to_string().len(), 32);
        for other in [
            TuningKey::new(Pass::Forward, "T", class, SM90, 1),
            TuningKey::new(Pass::Forward, "S", other_class, SM90, 1),
            TuningKey::new(Pass::Forward, "S", class, Arch::new(8, 0), 1),
            TuningKey::new(Pass::Forward, "S", class, SM90, 2),
            TuningKey::new(Pass::Backward, "S", class, SM90, 1),
        ] {
            assert_ne!(base, other);
        }
    }

    /// A record of `spec` on Hopper whose second candidate won.
    fn record_text(spec: &Spec, key: TuningKey) -> (String, TileConfig) {
        let all = crate::tile_choice::candidates(spec, HOPPER);
        let times: Vec<_> = all.iter().enumerate().map(|(i, &c)| (c, (i != 0).then_some(1.0 + i as f64))).collect();
        let class = ShapeClass::new(spec, &shape(4, 16, 1024, 1024), 132);
        let record = Record { key, pass: Pass::Forward, spec, class, arch: SM90, times: &times, best: all[1] };
        (record.render(), all[1])
    }

    /// The forward's key of `spec` at 4 x 16 heads x 1024 queries and keys.
    fn forward_key(spec: &Spec) -> TuningKey {
        let class = ShapeClass::new(spec, &shape(4, 16, 1024, 1024), 132);
        TuningKey::new(Pass::Forward, "S", class, SM90, CODEGEN_VERSION)
    }

    #[test]
    fn records_round_trip_through_the_disk_cache() {
        let tmp = TempDir::new("tuning-round-trip");
        let cache = DiskCache::at(&tmp.0);
        let spec = spec(128);
        let key = forward_key(&spec);
        let all = crate::tile_choice::candidates(&spec, HOPPER);
        assert_eq!(cache.load_tuning(key, &all), None, "no record yet");
        let times: Vec<_> = all.iter().map(|&c| (c, Some(0.5))).collect();
        let class = ShapeClass::new(&spec, &shape(4, 16, 1024, 1024), 132);
        let record = Record { key, pass: Pass::Forward, spec: &spec, class, arch: SM90, times: &times, best: all[1] };
        cache.store_tuning(&record).unwrap();
        assert_eq!(cache.load_tuning(key, &all), Some(all[1]));
        let text = std::fs::read_to_string(cache.tuning_path(key)).unwrap();
        assert!(text.contains("\npass forward\nspec Causal\narch sm_90\nclass q<=1024 kv<=1024 waves<=4\n"), "{text}");
        let listed = cache.tunings().unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(cache.entries().unwrap().len(), 0, "tuning records are not kernels");
        let cleared = cache.clear().unwrap();
        assert_eq!((cleared.kernels, cleared.tunings), (0, 1));
        assert_eq!(cache.load_tuning(key, &all), None);
    }

    #[test]
    fn stale_and_damaged_records_are_ignored_and_deleted() {
        let tmp = TempDir::new("tuning-damaged");
        let cache = DiskCache::at(&tmp.0);
        let spec = spec(128);
        let key = forward_key(&spec);
        let (good, best) = record_text(&spec, key);
        let hopper = crate::tile_choice::candidates(&spec, HOPPER);
        let path = cache.tuning_path(key);
        let damaged: Vec<(&str, Vec<u8>)> = vec![
            ("truncated", good.as_bytes()[..good.len() / 2].to_vec()),
            ("no end line", good.replace("end\n", "").into_bytes()),
            ("bad magic", good.replace("flashgen-tuning 1", "flashgen-tuning 9").into_bytes()),
            ("other key", good.replace(&key.to_string(), &"0".repeat(32)).into_bytes()),
            (
                "unknown winner",
                good.replace(&format!("best {}", config_name(best)), "best sync.w3.m3.n48").into_bytes(),
            ),
            ("no winner", good.replace(&format!("best {}\n", config_name(best)), "").into_bytes()),
            ("not UTF-8", [good.as_bytes(), b"\xff\xfe"].concat()),
            ("empty", vec![]),
        ];
        for (what, bytes) in damaged {
            std::fs::create_dir_all(cache.tuning_dir()).unwrap();
            std::fs::write(&path, bytes).unwrap();
            assert_eq!(cache.load_tuning(key, &hopper), None, "{what}");
            assert!(!path.exists(), "{what}: deleted");
        }
        // Tuned among Hopper's candidates: stale where the candidates differ.
        std::fs::write(&path, &good).unwrap();
        assert_eq!(cache.load_tuning(key, &crate::tile_choice::candidates(&spec, Target::PORTABLE)), None);
        assert!(!path.exists());
        std::fs::write(&path, &good).unwrap();
        assert_eq!(cache.load_tuning(key, &hopper), Some(best), "the untouched record is fine");
    }

    /// Parsing takes any text without panicking: every prefix of a record,
    /// and records with each line dropped or doubled.
    #[test]
    fn parsing_never_panics() {
        let spec = spec(64);
        let key = TuningKey::new(Pass::Forward, "S", ShapeClass::new(&spec, &shape(1, 1, 1, 1), 1), SM90, 1);
        let (good, _) = record_text(&spec, key);
        let all = crate::tile_choice::candidates(&spec, HOPPER);
        for end in 0..good.len() {
            let _ = parse(&good[..end], key, &all);
        }
        let lines: Vec<&str> = good.lines().collect();
        for i in 0..lines.len() {
            let mut dropped = lines.clone();
            dropped.remove(i);
            let _ = parse(&dropped.join("\n"), key, &all);
            let mut doubled = lines.clone();
            doubled.insert(i, lines[i]);
            let _ = parse(&doubled.join("\n"), key, &all);
        }
        assert!(parse(&good, key, &all).is_ok());
        assert!(parse::<TileConfig>(&good, key, &[]).is_err(), "no candidates");
    }

    #[test]
    fn the_environment_turns_tuning_on() {
        for (value, on) in
            [(None, false), (Some("1"), true), (Some("on"), true), (Some("ON"), true), (Some("0"), false)]
        {
            assert_eq!(autotune_from(value.map(OsString::from)), on, "{value:?}");
        }
        assert!(!autotune_from(Some(OsString::new())));
    }
}
