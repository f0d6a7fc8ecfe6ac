//! The dQ accumulator's tickets (`ArgKind::DqTickets`): the preprocess,
//! the dK/dV kernel and the postprocess around a Hopper accumulator take
//! them together, dense and varlen, or none of them does (masks that read a
//! tensor, and the `mma.sync` kernels' row-major accumulator).

use flashgen_codegen::abi::ArgKind;
use flashgen_codegen::cuda::{emit_backward_varlen, emit_backward_with, BackwardConfig, BackwardPass, Target};
use flashgen_codegen::parse_one;

const PASSES: [BackwardPass; 3] = [BackwardPass::Preprocess, BackwardPass::KeyValue, BackwardPass::Postprocess];

const SPECS: [&str; 5] = [
    "Full { dtype: bf16, head_dim: 128 }",
    "Causal64 { dtype: bf16, head_dim: 64, mask: q >= k }",
    "Mla { dtype: bf16, head_dim: 192, v_head_dim: 128, mask: q >= k }",
    "Soft256 { dtype: bf16, head_dim: 256, param cap: f32, score: cap * tanh(score / cap), mask: q >= k }",
    "Doc { dtype: bf16, head_dim: 128, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
];

#[test]
fn the_three_passes_take_tickets_together() {
    for text in SPECS {
        let spec = parse_one(text).unwrap();
        for target in [Target::for_sm(9, 0), Target::for_sm(8, 0)] {
            let config = BackwardConfig::preferred(&spec, target);
            let expected = config.dq_accum(&spec).has_tickets(&spec);
            let reads_tensor = spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
            assert_eq!(expected, target.sm == (9, 0) && !reads_tensor, "{} on sm_{:?}", spec.name, target.sm);
            for pass in PASSES {
                let config = config.for_pass(pass);
                for kernel in [emit_backward_with(&spec, pass, config), emit_backward_varlen(&spec, pass, config)] {
                    let takes = kernel.args.iter().any(|a| a.kind == ArgKind::DqTickets);
                    assert_eq!(takes, expected, "{} {pass:?} on sm_{:?}", spec.name, target.sm);
                    assert_eq!(
                        kernel.source.contains("dq_ticket_take(dq_ticket("),
                        expected && pass == BackwardPass::KeyValue
                    );
                }
            }
        }
    }
}
