//! The skeleton of a warp-specialized kernel, which the persistent forward
//! and the Hopper dK/dV kernel both instantiate with their role bodies: the
//! producer warpgroup (the warps past `WARPS`) gives up registers and runs
//! its body, which ends in `return`; the consumer warpgroups take the
//! registers and run theirs. The stage ring they share is the library's
//! (`library/ring.cuh`); each kernel declares its own barriers.

use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// `if (warp >= WARPS) { producer }`, then the consumers, each role behind
/// its `setmaxnreg`.
pub(crate) fn write_roles(
    w: &mut Writer<String>,
    producer: impl FnOnce(&mut Writer<String>) -> fmt::Result,
    consumers: impl FnOnce(&mut Writer<String>) -> fmt::Result,
) -> fmt::Result {
    w.block(format_args!("if (warp >= WARPS)"), |w| {
        writeln!(w, "// ---- the producer warpgroup ----")?;
        writeln!(w, "regs_release<PRODUCER_REGS>();")?;
        producer(w)
    })?;
    writeln!(w, "// ---- the consumer warpgroups ----")?;
    writeln!(w, "regs_acquire<CONSUMER_REGS>();")?;
    consumers(w)
}
