//! flashgen's tools, kept out of the `flashgen` library so that depending on
//! it pulls no command-line or random-number crates: the example specs
//! embedded, and the harness that draws random problems, runs them on the GPU
//! and checks them against the CPU reference (used by the `flashgen` CLI,
//! `flashgen-bench` and the GPU tests).

pub mod cp_bench;
pub mod decode_bench;
pub mod examples;
pub mod jit_bench;
pub mod prefill_bench;
pub mod spec_gen;
pub mod step_tiles;
pub mod verify;
