//! Forward cases on the GPU: a shape and an operand layout, launched in the
//! runtime's tile configuration or a pinned one, judged with
//! FlashAttention's rule against the f64 reference, one printed row each.

use flashgen::codegen::cuda::TileConfig;
use flashgen::codegen::reference::Problem;
use flashgen::codegen::{Shape, Spec};
use flashgen::{Error, Runtime};
use flashgen_tools::verify::{DeviceProblem, Expected, OperandLayout, Report};

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
            "{:<18} {:<4} d={:>3}/{:<3} h={:>2}/{:<2} s={:>4}/{:<4} {:<7} seed={seed}",
            spec.name,
            spec.dtype.name(),
            spec.head_dims.qk,
            spec.head_dims.v,
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

    pub fn finish(self) {
        let failures = self.failures;
        assert!(failures.is_empty(), "{} case(s) failed:\n{}", failures.len(), failures.join("\n"));
    }
}
