//! Forward cases on the GPU: a shape and an operand layout, launched in the
//! runtime's tile configuration or a pinned one, judged with
//! FlashAttention's rule against the f64 reference, one printed row each.

use super::{params, spec_columns};
use flashgen::codegen::cuda::TileConfig;
use flashgen::codegen::reference::{ParamValue, Problem};
use flashgen::codegen::{Shape, Spec};
use flashgen::runtime::{config_name, tile_choice};
use flashgen::{Error, Runtime};
use flashgen_tools::verify::{self, DeviceProblem, Expected, OperandLayout, Report};
use std::fmt::Display;

pub struct Case {
    pub batch: usize,
    pub heads: (usize, usize),
    pub seqs: (usize, usize),
    pub layout: OperandLayout,
}

impl Case {
    pub fn new(heads: (usize, usize), seqs: (usize, usize)) -> Self {
        Case { batch: 2, heads, seqs, layout: OperandLayout::Bshd }
    }

    pub fn shape(&self) -> Shape {
        Shape {
            batch: self.batch,
            heads: self.heads.0,
            heads_kv: self.heads.1,
            q_len: self.seqs.0,
            kv_len: self.seqs.1,
        }
    }

    /// The table row naming this case of `spec` drawn from `seed`.
    pub fn row(&self, spec: &Spec, seed: u64) -> String {
        format!(
            "{} h={:>2}/{:<2} s={:>4}/{:<4} {:<7} seed={seed}",
            spec_columns(spec),
            self.heads.0,
            self.heads.1,
            self.seqs.0,
            self.seqs.1,
            format!("{:?}", self.layout),
        )
    }
}

/// Uploads `problem` in `layout` (outputs NaN-poisoned), builds its block
/// mask if asked, launches once in `config` (`None`: the runtime's choice)
/// and judges the result.
pub fn run_once(
    rt: &Runtime,
    spec: &Spec,
    problem: &Problem,
    layout: OperandLayout,
    config: Option<TileConfig>,
    block_mask: bool,
    expected: &Expected,
) -> Result<Report, Error> {
    let mut gpu = DeviceProblem::upload(rt, spec, problem, layout)?;
    if block_mask {
        gpu.build_block_mask(rt, spec, problem)?;
    }
    gpu.pin_config(config);
    gpu.launch(rt, spec, problem)?;
    Ok(expected.check(&gpu.download()?))
}

/// Runs every (spec, case) pair once in the runtime's configuration on
/// fresh random inputs, prints a table and fails if any row failed.
pub fn run_all(rt: &Runtime, cases: Vec<(Spec, Case)>) {
    run_all_in(rt, cases, None)
}

/// [`run_all`] in `config` (`None`: the runtime's choice).
pub fn run_all_in(rt: &Runtime, cases: Vec<(Spec, Case)>, config: Option<TileConfig>) {
    let mut table = Table::default();
    for (spec, case) in cases {
        let seed: u64 = rand::random();
        let problem = verify::random_problem(&spec, case.shape(), params(&spec), vec![], None, seed);
        table.judge(case.row(&spec, seed), Expected::new(&spec, &problem), |expected| {
            run_once(rt, &spec, &problem, case.layout, config, false, expected)
        });
    }
    table.finish();
}

/// Each spec in every candidate configuration of `rt`'s GPU, with and
/// without a block mask, at three shapes (ragged lengths; GQA at 1024
/// queries; MQA past 2048 keys), one reference per shape; fails if any row
/// failed.
pub fn in_every_configuration(rt: &Runtime, specs: Vec<Spec>) {
    let cases = specs.into_iter().map(|spec| (params(&spec), spec)).collect();
    in_every_configuration_with(rt, cases)
}

/// [`in_every_configuration`], each spec with its own param values.
pub fn in_every_configuration_with(rt: &Runtime, specs: Vec<(Vec<ParamValue>, Spec)>) {
    in_configurations(rt, specs, &|spec| tile_choice::candidates(spec, rt.target()))
}

/// [`in_every_configuration_with`] in the configurations `configs` gives
/// each spec.
pub fn in_configurations(
    rt: &Runtime,
    specs: Vec<(Vec<ParamValue>, Spec)>,
    configs: &dyn Fn(&Spec) -> Vec<TileConfig>,
) {
    let mut table = Table::default();
    for (values, spec) in specs {
        for (heads, seqs) in [((4, 4), (113, 203)), ((4, 2), (1024, 1023)), ((2, 1), (300, 2100))] {
            let case = Case::new(heads, seqs);
            let seed: u64 = rand::random();
            let problem = verify::random_problem(&spec, case.shape(), values.clone(), vec![], None, seed);
            let expected = Expected::new(&spec, &problem).unwrap();
            for config in configs(&spec) {
                // A block mask refines a mask: unmasked specs take none.
                for block_mask in [false, true].into_iter().filter(|&b| !b || spec.mask.is_some()) {
                    let row = format!(
                        "{} {} block mask {block_mask} params {values:?}",
                        case.row(&spec, seed),
                        config_name(config)
                    );
                    let outcome = run_once(rt, &spec, &problem, case.layout, Some(config), block_mask, &expected);
                    table.record(row, outcome.map_err(|e| e.to_string()));
                }
            }
        }
    }
    table.finish();
}

/// Rows printed as they come; [`Table::finish`] fails the test if any failed.
#[derive(Default)]
pub struct Table {
    failures: Vec<String>,
}

impl Table {
    pub fn record(&mut self, row: String, outcome: Result<Report, String>) {
        match outcome {
            Ok(report) if report.passed() => {
                println!("ok     {row}  err {:.2e} ≤ {:.2e}", report.output.error, report.output.tolerance)
            }
            Ok(report) => {
                println!("FAILED {row}  O: {}  LSE: {}", report.output, report.lse);
                self.failures.push(row);
            }
            Err(e) => {
                println!("ERROR  {row}  {e}");
                self.failures.push(row);
            }
        }
    }

    /// Records `row` with `run`'s report against `expected`, or the error of
    /// either.
    pub fn judge<E: Display>(
        &mut self,
        row: String,
        expected: Result<Expected, E>,
        run: impl FnOnce(&Expected) -> Result<Report, Error>,
    ) {
        let outcome =
            expected.map_err(|e| e.to_string()).and_then(|expected| run(&expected).map_err(|e| e.to_string()));
        self.record(row, outcome);
    }

    pub fn finish(self) {
        let failures = self.failures;
        assert!(failures.is_empty(), "{} case(s) failed:\n{}", failures.len(), failures.join("\n"));
    }
}
