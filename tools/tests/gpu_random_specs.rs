//! GPU agreement of random well-typed specs (`flashgen_tools::spec_gen`)
//! with the f64 reference: each drawn spec's forward (the runtime's kernel
//! for the shape) and its backward with every tensor gradient, judged with
//! FlashAttention's rule on fresh random inputs with poisoned outputs.
//!
//! Ignored by a plain `cargo test`: they need a GPU. `FLASHGEN_RANDOM_SPECS`
//! sets the number of specs, `FLASHGEN_RANDOM_SEED` replays a draw.

#[allow(dead_code)] // the example specs' helpers: drawn specs bring their own params
mod support;

use flashgen::codegen::Shape;
use flashgen_tools::spec_gen::random_spec;
use flashgen_tools::verify::{self, DeviceProblem, Expected, OperandLayout};
use rand::rngs::StdRng;
use rand::SeedableRng;
use support::forward::Table;
use support::runtime;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
#[ignore = "needs a GPU"]
fn random_specs_agree_with_the_reference() {
    let rt = runtime();
    let seed = env_or("FLASHGEN_RANDOM_SEED", std::process::id() as u64);
    println!("seed {seed} (FLASHGEN_RANDOM_SEED replays it)");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut table = Table::default();
    let mut backward_failures = Vec::new();
    for n in 0..env_or("FLASHGEN_RANDOM_SPECS", 12) as usize {
        let drawn = random_spec(&mut rng, n);
        let spec = flashgen::parse_one(&drawn.source).expect("drawn specs check");
        let shape = Shape { batch: 2, heads: 4, heads_kv: 2, q_len: 96 + n % 3 * 17, kv_len: 160 - n % 2 * 41 };
        let problem = verify::random_problem(&spec, shape, drawn.params, vec![], None, seed + n as u64);
        let row = format!("{}  seed={seed} q={} kv={}", drawn.source.replace('\n', " "), shape.q_len, shape.kv_len);
        let expected = Expected::new(&spec, &problem).expect("a reference forward");
        let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, OperandLayout::Bshd).expect("upload");
        let forward = gpu.launch(&rt, &spec, &problem).and_then(|()| gpu.download());
        table.record(row.clone(), forward.map(|out| expected.check(&out)).map_err(|e| e.to_string()));
        let d_out = verify::random_d_out(&spec, shape, seed + n as u64);
        let grads = gpu.backward(&rt, &spec, &problem, &d_out, true, true, None);
        match grads
            .map_err(|e| e.to_string())
            .and_then(|g| verify::check_backward(&spec, &problem, &d_out, &g).map_err(|e| e.to_string()))
        {
            Ok(report) if report.passed() => println!("ok     backward of Drawn{n}"),
            Ok(report) => {
                println!(
                    "FAILED backward {row}: dQ {} dK {} dV {} {:?}",
                    report.dq, report.dk, report.dv, report.d_tensors
                );
                backward_failures.push(row);
            }
            Err(e) => {
                println!("ERROR  backward {row}: {e}");
                backward_failures.push(row);
            }
        }
    }
    assert!(backward_failures.is_empty(), "backward failures:\n{}", backward_failures.join("\n"));
    table.finish();
}
