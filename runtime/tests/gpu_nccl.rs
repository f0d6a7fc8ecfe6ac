//! NCCL communicators on real GPUs: one process driving every visible GPU
//! (`Communicator::all_local`), a rank per thread; a ring exchange, an
//! all-gather and a reduce-scatter, each checked exactly on the host after
//! a read on the compute stream (so also the ordering between the compute
//! and communication streams). Ignored by a plain `cargo test`; run with
//! `--include-ignored`, where a missing GPU fails it and a machine of one
//! GPU says it needs 2 and passes.

#![cfg(feature = "nccl")]

use flashgen_runtime::cudarc::driver::CudaContext;
use flashgen_runtime::half::bf16;
use flashgen_runtime::{CommError, Communicator, Error, Runtime};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Elements of one rank's block.
const BLOCK: usize = 4099;

/// Rank `r`'s block: integers in [-125, 125], exact in bf16.
fn block(r: usize) -> Vec<f32> {
    (0..BLOCK).map(|i| ((r * BLOCK + i) % 251) as f32 - 125.0).collect()
}

fn to_bf16(values: &[f32]) -> Vec<bf16> {
    values.iter().copied().map(bf16::from_f32).collect()
}

#[test]
#[ignore = "needs 2 or more NVIDIA GPUs (run with --include-ignored)"]
fn ranks_exchange_gather_and_reduce_scatter_exactly() -> TestResult {
    let first = Runtime::new(0).unwrap_or_else(|e| panic!("a GPU test needs a working NVIDIA GPU: {e}"));
    let count = CudaContext::device_count()? as usize;
    if count < 2 {
        println!("gpu_nccl needs 2 GPUs, this machine has {count}: nothing checked");
        return Ok(());
    }
    let mut runtimes = vec![first];
    for ordinal in 1..count {
        runtimes.push(Runtime::new(ordinal)?);
    }
    let repeated = Communicator::all_local(&[&runtimes[0], &runtimes[1], &runtimes[0]]).unwrap_err();
    assert!(matches!(repeated, Error::Comm(CommError::RepeatedDevice { ordinal: 0 })), "{repeated}");
    assert!(matches!(Communicator::all_local(&[]).unwrap_err(), Error::Comm(CommError::Rank { world: 0, .. })));

    let comms = Communicator::all_local(&runtimes.iter().collect::<Vec<_>>())?;
    // NCCL calls block until every rank joins: one thread per rank.
    std::thread::scope(|s| {
        let ranks: Vec<_> =
            comms.into_iter().zip(&runtimes).map(|(comm, rt)| s.spawn(move || check_rank(rt, comm))).collect();
        ranks.into_iter().try_for_each(|rank| rank.join().expect("a rank's thread panicked"))
    })?;
    println!("gpu_nccl: {count} ranks exchanged, gathered and reduce-scattered exactly");
    Ok(())
}

/// Every check of one rank, its results read on its compute stream.
fn check_rank(rt: &Runtime, comm: Communicator) -> TestResult {
    let (rank, world, stream) = (comm.rank(), comm.world(), rt.stream());
    assert_eq!(rt.context().ordinal(), rank, "rank i runs on runtimes[i]");
    assert!(!std::sync::Arc::ptr_eq(comm.stream(), stream), "a stream of its own");

    // A ring: each rank's block to the next, in bf16.
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let send = stream.clone_htod(&to_bf16(&block(rank)))?;
    let mut recv = stream.clone_htod(&vec![bf16::NAN; BLOCK])?;
    comm.exchange(&[(next, &send.slice(..))], &mut [(prev, &mut recv.slice_mut(..))])?;
    assert_eq!(stream.clone_dtoh(&recv)?, to_bf16(&block(prev)), "rank {rank}: the block from rank {prev}");

    // Typed errors before NCCL sees anything.
    let own = comm.exchange(&[(rank, &send.slice(..))], &mut []).unwrap_err();
    assert!(matches!(own, Error::Comm(CommError::SelfPeer { .. })), "{own}");
    let outside = comm.exchange(&[], &mut [(world, &mut recv.slice_mut(..))]).unwrap_err();
    assert!(matches!(outside, Error::Comm(CommError::Peer { .. })), "{outside}");

    // Every block, in rank order, on every rank.
    let local = stream.clone_htod(&block(rank))?;
    let mut gathered = stream.clone_htod(&vec![f32::NAN; world * BLOCK])?;
    comm.all_gather(&local.slice(..), &mut gathered.slice_mut(..))?;
    let all: Vec<f32> = (0..world).flat_map(block).collect();
    assert_eq!(stream.clone_dtoh(&gathered)?, all, "rank {rank}: the gathered blocks");
    let short = comm.all_gather(&local.slice(..), &mut gathered.slice_mut(1..)).unwrap_err();
    assert!(matches!(short, Error::Comm(CommError::Length { .. })), "{short}");

    // Rank r adds (r + 1) · (j % 97) at j: the sum is exact in f32.
    let full: Vec<f32> = (0..world * BLOCK).map(|j| ((rank + 1) * (j % 97)) as f32).collect();
    let full = stream.clone_htod(&full)?;
    let mut part = stream.clone_htod(&vec![f32::NAN; BLOCK])?;
    comm.reduce_scatter_sum(&full.slice(..), &mut part.slice_mut(..))?;
    let sums: Vec<f32> =
        (rank * BLOCK..(rank + 1) * BLOCK).map(|j| ((j % 97) * world * (world + 1) / 2) as f32).collect();
    assert_eq!(stream.clone_dtoh(&part)?, sums, "rank {rank}: its part of the sum");
    Ok(())
}
