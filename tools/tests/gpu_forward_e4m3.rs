//! GPU correctness of the e4m3 forward (`Runtime::forward_e4m3`): every
//! example spec, bf16 and f16 output, head dims 128 and 64, GQA and MQA,
//! ragged and bottom-right-aligned lengths, BSHD and BHSD operands,
//! descales per tensor and per K/V head, with and without a block mask,
//! judged with FlashAttention-3's FP8 rule: the f64 reference reads the
//! dequantized values the kernel reads (`verify::forward_e4m3`), and the
//! error may be twice a baseline's that rounds P to e4m3. Then its typed
//! errors.
//!
//! Ignored by a plain `cargo test`: they need a Hopper GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs (the seed is printed).

mod support;

use flashgen::codegen::cuda::{Mma, TileConfig};
use flashgen::codegen::{Dtype, Shape, Spec};
use flashgen::runtime::{
    config_name, DropoutError, E4m3Error, Error, ForwardE4m3Io, ForwardOptions, Layout, QkvDescale, RaggedError,
    Runtime,
};
use flashgen::Dropout;
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::decode_e4m3::Granularity;
use flashgen_tools::verify::forward_e4m3::quantize_operands;
use flashgen_tools::verify::{self, DeviceProblem, Expected, OperandLayout, Report};
use support::forward::{Case, Table};
use support::{params, runtime, spec, with};

/// Quantizes a fresh problem of `spec` in `case`'s shape, uploads it
/// (outputs NaN-poisoned), launches the e4m3 forward once and judges it.
fn run_once(
    rt: &Runtime,
    spec: &Spec,
    case: &Case,
    granularity: Granularity,
    (config, block_mask): (Option<TileConfig>, bool),
    seed: u64,
) -> Result<Report, String> {
    let mut problem = verify::random_problem(spec, case.shape(), params(spec), vec![], None, seed);
    let operands = quantize_operands(spec, &mut problem, granularity);
    let expected = Expected::e4m3(spec, &problem).map_err(|e| e.to_string())?;
    let run = || -> Result<Report, Error> {
        let mut gpu = DeviceProblem::upload(rt, spec, &problem, case.layout)?;
        gpu.use_e4m3(&operands)?;
        gpu.pin_config(config);
        if block_mask {
            gpu.build_block_mask(rt, spec, &problem)?;
        }
        gpu.launch(rt, spec, &problem)?;
        Ok(expected.check(&gpu.download()?))
    };
    run().map_err(|e| e.to_string())
}

#[test]
#[ignore = "needs an NVIDIA Hopper GPU (run with --include-ignored)"]
fn every_spec_matches_the_reference() {
    let rt = runtime();
    let mut table = Table::default();
    let shapes = [
        ((4, 2), (333, 333), OperandLayout::Bshd),
        ((8, 1), (200, 700), OperandLayout::Bhsd),
        ((2, 2), (1024, 1030), OperandLayout::Bshd),
    ];
    for (i, (variant, _)) in SPECS.iter().enumerate() {
        for (j, &(heads, seqs, layout)) in shapes.iter().enumerate() {
            let (dtype, d) = match (i + j) % 3 {
                0 => (Dtype::F16, 64),
                _ => (Dtype::Bf16, 128),
            };
            let spec = with(spec(variant), dtype, d, d);
            let granularity = if (i + j) % 2 == 0 { Granularity::PerKvHead } else { Granularity::PerTensor };
            let block_mask = spec.mask.is_some() && j == 2;
            let case = Case { layout, ..Case::new(heads, seqs) };
            let seed: u64 = rand::random();
            let row = format!("{} {granularity:?} block mask {block_mask}", case.row(&spec, seed));
            table.record(row, run_once(&rt, &spec, &case, granularity, (None, block_mask), seed));
        }
    }
    table.finish();
}

#[test]
#[ignore = "needs an NVIDIA Hopper GPU (run with --include-ignored)"]
fn every_tile_configuration_matches_the_reference() {
    let rt = runtime();
    let mut table = Table::default();
    let tile = |warps, block_n| TileConfig { mma: Mma::Wgmma, warps, m_tiles: 1, block_n };
    let configs = [tile(8, 96), tile(8, 128), tile(8, 160), tile(8, 192), tile(8, 224), tile(12, 160), tile(4, 128)];
    for config in configs {
        for (variant, d) in [("causal", 128), ("document", 64), ("softcap", 96)] {
            let spec = with(spec(variant), Dtype::Bf16, d, d);
            let case = Case::new((4, 1), (517, 1100));
            let seed: u64 = rand::random();
            let row = format!("{} {}", case.row(&spec, seed), config_name(config));
            table.record(
                row,
                run_once(&rt, &spec, &case, Granularity::PerKvHead, (Some(config), variant == "document"), seed),
            );
        }
    }
    table.finish();
}

/// One key and one query; one query against a partial last tile.
#[test]
#[ignore = "needs an NVIDIA Hopper GPU (run with --include-ignored)"]
fn single_rows_match_the_reference() {
    let rt = runtime();
    let mut table = Table::default();
    for (variant, seqs) in [("full", (3, 1)), ("causal", (1, 1)), ("causal_bottom_right", (1, 300))] {
        let spec = spec(variant);
        let case = Case::new((4, 2), seqs);
        let seed: u64 = rand::random();
        table.record(case.row(&spec, seed), run_once(&rt, &spec, &case, Granularity::PerTensor, (None, false), seed));
    }
    table.finish();
}

/// What a refused launch returned, for the assertions below.
fn refused(rt: &Runtime, spec: &Spec, layouts: [Layout; 4], descale_len: usize, dropout: Option<Dropout>) -> Error {
    let stream = rt.stream();
    let bytes = |l: &Layout| stream.alloc_zeros::<u8>(2 * l.len()).unwrap();
    let (q, k, v) = (bytes(&layouts[0]), bytes(&layouts[1]), bytes(&layouts[2]));
    let mut o = stream.alloc_zeros::<flashgen::half::bf16>(layouts[3].len()).unwrap();
    let ones = stream.clone_htod(&vec![1.0f32; descale_len]).unwrap();
    let one = stream.clone_htod(&[1.0f32]).unwrap();
    let descale = QkvDescale {
        q: flashgen::runtime::Descale::PerKvHead(&ones),
        k: flashgen::runtime::Descale::PerTensor(&one),
        v: flashgen::runtime::Descale::PerTensor(&one),
    };
    let io = ForwardE4m3Io {
        q: (&q, layouts[0]),
        k: (&k, layouts[1]),
        v: (&v, layouts[2]),
        o: (&mut o, layouts[3]),
        lse: None,
    };
    let opts = ForwardOptions { dropout, ..Default::default() };
    rt.forward_e4m3(spec, io, descale, &[], &opts).expect_err("a launch that must be refused ran")
}

#[test]
#[ignore = "needs an NVIDIA Hopper GPU (run with --include-ignored)"]
fn bad_inputs_get_typed_errors() {
    let rt = runtime();
    let spec = spec("causal");
    let shape = Shape { batch: 2, heads: 4, heads_kv: 2, q_len: 256, kv_len: 256 };
    let bshd = |heads| Layout::bshd(shape.batch, shape.q_len, heads, 128);
    let dense = [bshd(4), bshd(2), bshd(2), bshd(4)];
    // Rows 136 bytes apart: TMA needs 16-byte multiples.
    let padded = OperandLayout::Padded;
    let unaligned = [padded.layout(2, 256, 4, 128), padded.layout(2, 256, 2, 128), bshd(2), bshd(4)];
    let check = |what: &str, error: Error, expected: fn(&Error) -> bool| {
        println!("{what}: {error}");
        assert!(expected(&error), "{what}: {error:?}");
    };
    check("unaligned Q", refused(&rt, &spec, unaligned, 2, None), |e| {
        matches!(e, Error::E4m3(E4m3Error::Unaligned { operand: "Q" }))
    });
    check("Q descales of 3 for 2 K/V heads", refused(&rt, &spec, dense, 3, None), |e| {
        matches!(e, Error::Ragged(RaggedError::DescaleLen { operand: "Q", len: 3, expected: 2, .. }))
    });
    let dropout = Some(Dropout { p: 0.1, seed: 1, offset: 0 });
    check("dropout", refused(&rt, &spec, dense, 2, dropout), |e| {
        matches!(e, Error::Dropout(DropoutError::Unsupported { .. }))
    });
    let narrow = dense.map(|l| Layout::bshd(l.batch, l.seq, l.heads, 80));
    check("head dim 80", refused(&rt, &with(spec.clone(), Dtype::Bf16, 80, 80), narrow, 2, None), |e| {
        matches!(e, Error::E4m3(E4m3Error::Config { .. }))
    });
}
