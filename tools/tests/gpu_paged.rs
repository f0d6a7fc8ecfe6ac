//! GPU correctness of the paged forward and the paged append, judged with
//! FlashAttention's rule against the f64 reference of the sequences'
//! gathered keys (`flashgen_tools::verify::paged`): page sizes 1, 3, 16,
//! 64 and 256 over shuffled block tables, ragged lengths, chunked prefill
//! (fewer queries than keys), packed and dense queries, GQA, every example
//! spec, and an append before the attention.
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs (the seed is printed).

mod support;

use flashgen::codegen::paged::{paged_kv_len, paged_row, PagedRows};
use flashgen::codegen::reference::PagedProblem;
use flashgen::codegen::{Dtype, Spec};
use flashgen::half::bf16;
use flashgen::runtime::tile_choice;
use flashgen::runtime::RaggedError;
use flashgen::{Error, PagedIo, PagedKv, PagedLayout, PagedQueries, Runtime};
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::paged::{hold_back, into_pages, DevicePaged, Queries};
use flashgen_tools::verify::varlen::random_varlen_problem;
use flashgen_tools::verify::{Expected, Report};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::forward::Table;
use support::packed::rejected_buffers;
use support::{heads_of, params, runtime, spec, with};

/// One paged case: a spec, its heads, its sequences' (queries, keys), the
/// page size and how queries are passed.
struct Case {
    spec: Spec,
    heads: (usize, usize),
    lens: Vec<(usize, usize)>,
    page_size: usize,
    queries: Queries,
}

impl Case {
    fn row(&self, seed: u64) -> String {
        let (total_q, total_kv) = self.lens.iter().fold((0, 0), |(q, k), l| (q + l.0, k + l.1));
        format!(
            "{:<18} h={}/{} seqs={:<2} tokens={:>4}/{:<5} page={:<3} {:?} seed={seed}",
            self.spec.name,
            self.heads.0,
            self.heads.1,
            self.lens.len(),
            total_q,
            total_kv,
            self.page_size,
            self.queries,
        )
    }

    /// The case's random problem in pages (two spare pages of noise).
    fn problem(&self, seed: u64) -> PagedProblem {
        let varlen = random_varlen_problem(&self.spec, self.heads, &self.lens, params(&self.spec), seed);
        into_pages(&self.spec, &varlen, self.page_size, 2, seed)
    }
}

/// Uploads the case's problem, launches once and judges the result.
fn run_once(rt: &Runtime, case: &Case, problem: &PagedProblem, expected: &Expected) -> Result<Report, Error> {
    let mut gpu = DevicePaged::upload(rt, &case.spec, problem, case.queries)?;
    gpu.launch(rt, &case.spec, problem)?;
    Ok(expected.check(&gpu.download()?))
}

/// Runs every case, prints a table and fails if any row failed.
fn run_all(rt: &Runtime, cases: Vec<Case>) {
    let mut table = Table::default();
    for case in cases {
        let seed: u64 = rand::random();
        let problem = case.problem(seed);
        let expected = Expected::paged(&case.spec, &problem);
        table.judge(case.row(seed), expected, |expected| run_once(rt, &case, &problem, expected));
    }
    table.finish();
}

/// Chunked prefill over ragged caches: an empty chunk, single tokens, a
/// sequence without keys, odd lengths, whole prompts (q = kv), and one
/// sequence much longer than the rest; shuffled.
fn ragged(rng: &mut StdRng) -> Vec<(usize, usize)> {
    support::ragged(rng, &[(0, 13), (1, 1), (1, 40), (0, 0), (17, 17), (64, 700)], (3, 40), |q, rng| {
        q + rng.random_range(0..150)
    })
}

const PAGE_SIZES: [usize; 5] = [1, 3, 16, 64, 256];

/// Every example spec on ragged chunks, the page sizes taken in turn.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_variant_over_shuffled_pages() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let cases = SPECS
        .iter()
        .enumerate()
        .map(|(i, (variant, _))| Case {
            spec: spec(variant),
            heads: heads_of(variant),
            lens: ragged(&mut rng),
            page_size: PAGE_SIZES[i % PAGE_SIZES.len()],
            queries: Queries::Packed,
        })
        .collect();
    run_all(&rt, cases);
}

/// Every page size under a bottom-right causal mask (chunked prefill) and
/// GQA, with packed and dense queries (dense: every sequence a chunk of the
/// same length); f16, d = 64 and odd head dims.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_page_size_with_packed_and_dense_queries() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for page_size in PAGE_SIZES {
        for (variant, queries) in [("causal_bottom_right", Queries::Packed), ("gqa", Queries::Dense)] {
            let lens = match queries {
                Queries::Packed => ragged(&mut rng),
                Queries::Dense => [1, 37, 300, 96].map(|extra| (33, 33 + extra)).to_vec(),
            };
            cases.push(Case { spec: spec(variant), heads: heads_of(variant), lens, page_size, queries });
        }
    }
    // f16 at d = 64, and head dims that are not a multiple of 8 (rows
    // gathered element by element).
    for (spec, heads, page_size) in [
        (with(spec("causal_bottom_right"), Dtype::F16, 64, 64), (4, 4), 3),
        (with(spec("causal"), Dtype::Bf16, 59, 59), (3, 3), 16),
    ] {
        cases.push(Case { spec, heads, lens: ragged(&mut rng), page_size, queries: Queries::Packed });
    }
    run_all(&rt, cases);
}

/// Every tile configuration the runtime may pick on this GPU (mma.sync,
/// wgmma, and the persistent kernels whose producer gathers the pages).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_candidate_configuration() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let spec = spec("causal_bottom_right");
    for config in tile_choice::candidates(&spec, rt.target()) {
        let case =
            Case { spec: spec.clone(), heads: (6, 2), lens: ragged(&mut rng), page_size: 16, queries: Queries::Packed };
        let seed: u64 = rand::random();
        let problem = case.problem(seed);
        let expected = Expected::paged(&spec, &problem).unwrap();
        let mut gpu = DevicePaged::upload(&rt, &spec, &problem, Queries::Packed).unwrap();
        gpu.pin_config(Some(config));
        gpu.launch(&rt, &spec, &problem).unwrap();
        let report = expected.check(&gpu.download().unwrap());
        assert!(report.passed(), "{config:?} seed {seed}: O {}  LSE {}", report.output, report.lse);
    }
}

/// A serving step: the caches hold each sequence's keys but its last few,
/// the append writes those (one sequence appends nothing, one a whole
/// chunk), the lengths after come back right, and attention over the
/// caches then matches the reference of the full sequences.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn append_then_attend() {
    let rt = runtime();
    for (variant, page_size) in [("causal_bottom_right", 16), ("gqa", 3), ("document", 64)] {
        let case = Case {
            spec: spec(variant),
            heads: heads_of(variant),
            lens: vec![(1, 1), (1, 50), (0, 20), (40, 40), (7, 300)],
            page_size,
            queries: Queries::Packed,
        };
        let seed: u64 = rand::random();
        let full = case.problem(seed);
        let (before, rows) = hold_back(&case.spec, &full, &[1, 1, 0, 40, 7]);
        let expected = Expected::paged(&case.spec, &full).unwrap();
        let mut gpu = DevicePaged::upload(&rt, &case.spec, &before, Queries::Packed).unwrap();
        let (lens, dropped) = gpu.append(&rt, &case.spec, &rows).unwrap();
        let want: Vec<i32> = full.kv_lens.iter().map(|&l| l as i32).collect();
        assert_eq!((lens, dropped), (want, 0), "{variant} seed {seed}");
        gpu.launch(&rt, &case.spec, &full).unwrap();
        let report = expected.check(&gpu.download().unwrap());
        assert!(report.passed(), "{variant} seed {seed}: O {}  LSE {}", report.output, report.lse);
    }
}

/// Rows past a sequence's pages are dropped and counted, never written
/// elsewhere: appending a full sequence's keys again (its pages are full)
/// drops them all and leaves every page as it was.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn appends_past_the_pages_are_dropped() {
    let rt = runtime();
    let case = Case {
        spec: spec("causal"),
        heads: (2, 2),
        lens: vec![(4, 32), (4, 20)],
        page_size: 16,
        queries: Queries::Packed,
    };
    let full = case.problem(rand::random());
    let expected = Expected::paged(&case.spec, &full).unwrap();
    // Sequence 0 fills its two pages; sequence 1 has room for 12 more.
    let (_, rows) = hold_back(&case.spec, &full, &[32, 20]);
    let mut gpu = DevicePaged::upload(&rt, &case.spec, &full, Queries::Packed).unwrap();
    let (lens, dropped) = gpu.append(&rt, &case.spec, &rows).unwrap();
    assert_eq!((lens, dropped), (vec![32, 32], 32 + 8));
    // Sequence 0's pages are untouched; sequence 1's keys 0..20 too.
    gpu.set_device_table(&full.block_table.iter().map(|&p| p as i32).collect::<Vec<_>>(), &[32, 20]).unwrap();
    gpu.launch(&rt, &case.spec, &full).unwrap();
    let report = expected.check(&gpu.download().unwrap());
    assert!(report.passed(), "O {}  LSE {}", report.output, report.lse);
}

/// Page ids and lengths on the device that the caches cannot hold are
/// clamped, as the CPU twin says: lengths past the table's pages read as
/// its pages' rows (right here, since those are the sequence's keys), and
/// arbitrary ids and lengths give some result without any access outside
/// the caches (a fault would fail the download).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_device_tables_stay_in_bounds() {
    let rt = runtime();
    let case = Case {
        spec: spec("causal_bottom_right"),
        heads: (2, 1),
        lens: vec![(10, 48), (30, 30)],
        page_size: 16,
        queries: Queries::Packed,
    };
    let problem = case.problem(rand::random());
    let expected = Expected::paged(&case.spec, &problem).unwrap();
    let table: Vec<i32> = problem.block_table.iter().map(|&p| p as i32).collect();
    // Sequence 0 holds 48 keys in 3 pages: a length of 10_000 clamps to them.
    let per_seq = problem.pages_per_seq as i32;
    assert_eq!(paged_kv_len(&[10_000], 0, per_seq, 16, 8, 48), 48);
    let pages = [-4, 99];
    let rows = PagedRows { pages: &pages, page_size: 16, num_pages: 8, page_stride: 16, row_stride: 1 };
    assert_eq!((paged_row(&rows, 0), paged_row(&rows, 17)), (0, 7 * 16 + 1));
    for config in tile_choice::candidates(&case.spec, rt.target()) {
        let mut gpu = DevicePaged::upload(&rt, &case.spec, &problem, Queries::Packed).unwrap();
        gpu.pin_config(Some(config));
        gpu.set_device_table(&table, &[10_000, 30]).unwrap();
        gpu.launch(&rt, &case.spec, &problem).unwrap();
        let report = expected.check(&gpu.download().unwrap());
        assert!(report.passed(), "{config:?}: O {}  LSE {}", report.output, report.lse);
        let garbage =
            table.iter().enumerate().map(|(i, &p)| [p, -1, i32::MAX, i32::MIN, 5000][i % 5]).collect::<Vec<_>>();
        for lens in [[-7, i32::MAX], [i32::MIN, 3], [47, 31]] {
            gpu.set_device_table(&garbage, &lens).unwrap();
            gpu.launch(&rt, &case.spec, &problem).unwrap();
            gpu.download().unwrap_or_else(|e| panic!("{config:?} on {lens:?}: {e}"));
        }
    }
}

/// Bad paged launches are typed errors, never launches.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_launches_are_rejected() {
    let rt = runtime();
    let spec = spec("causal");
    let stream = rt.stream();
    let (q_layout, q, mut o) = rejected_buffers(&rt);
    let cache = PagedLayout::contiguous(10, 16, 2, 128);
    let k = stream.alloc_zeros::<bf16>(cache.as_layout().len()).unwrap();
    let cu = stream.clone_htod(&[0i32, 50, 100]).unwrap();
    let table = stream.clone_htod(&[0i32; 8]).unwrap();
    let lens = stream.clone_htod(&[64i32, 64]).unwrap();
    let mut launch = |page_size: usize, pages_per_seq: usize, max_kv_len: usize, queries: PagedQueries| {
        let layout = PagedLayout { page_size, ..cache };
        let kv = PagedKv {
            k: (&k, layout),
            v: (&k, layout),
            block_table: &table,
            pages_per_seq,
            kv_lens: &lens,
            max_kv_len,
            batch: 2,
        };
        let io = PagedIo { q: (&q, q_layout), o: (&mut o, q_layout), lse: None, queries, kv };
        rt.forward_paged(&spec, io, &[], &Default::default()).unwrap_err()
    };
    let packed = || PagedQueries::Packed { cu_seqlens_q: &cu, max_q_len: 50 };
    let err = launch(0, 4, 0, packed());
    assert!(matches!(err, Error::Ragged(RaggedError::ZeroPageSize)), "{err}");
    let err = launch(16, 3, 48, packed());
    assert!(
        matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "block_table", len: 8, expected: 6 })),
        "{err}"
    );
    let err = launch(16, 4, 65, packed());
    assert!(matches!(err, Error::Ragged(RaggedError::MaxKvLenPastPages { max_kv_len: 65, capacity: 64 })), "{err}");
    let err = launch(32, 4, 64, packed());
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    let err = launch(16, 4, 64, PagedQueries::Dense { q_len: 49 });
    assert!(matches!(err, Error::Ragged(RaggedError::DenseQueries { tokens: 100, batch: 2, q_len: 49 })), "{err}");
}
