//! What a kernel is generated for: the GPU's MMA instructions and the
//! resources a tile plan must fit. Emitters read hardware facts from a
//! [`Target`], never from constants of their own.

/// Which tensor-core instructions a forward kernel is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mma {
    /// Warp-level `mma.sync.m16n8k16` fed by `ldmatrix`: every GPU from sm_80.
    Sync,
    /// Hopper's warpgroup-level `wgmma.mma_async` reading K and V (and Q)
    /// straight from shared memory: sm_90a only.
    Wgmma,
}

/// The GPU a kernel is generated for, as data: its compute capability, the
/// MMA instructions and copy engine it offers, and the per-SM resources a
/// kernel's plan must fit. A new architecture path is a new `Target` (and,
/// for new tensor-core instructions, a new [`Mma`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// Compute capability `(major, minor)`.
    pub sm: (u32, u32),
    /// The richest tensor-core instructions it runs: `Mma::Wgmma` on sm_90
    /// (compiled as sm_90a), else `Mma::Sync`.
    pub mma: Mma,
    /// The tensor memory accelerator (`cp.async.bulk.tensor`).
    pub tma: bool,
    /// Shared memory per SM, bytes.
    pub smem_per_sm: u32,
    /// Shared memory the driver reserves per resident CTA, bytes.
    pub smem_reserved_per_cta: u32,
    /// 32-bit registers per SM.
    pub regs_per_sm: u32,
}

impl Target {
    /// Any sm_80-class GPU (A100's shared memory).
    pub const PORTABLE: Target = Target {
        sm: (8, 0),
        mma: Mma::Sync,
        tma: false,
        smem_per_sm: 164 * 1024,
        smem_reserved_per_cta: 1024,
        regs_per_sm: 65536,
    };

    /// Hopper (sm_90a): warpgroup MMA, TMA, 228 KiB of shared memory per SM.
    pub const HOPPER: Target = Target {
        sm: (9, 0),
        mma: Mma::Wgmma,
        tma: true,
        smem_per_sm: 228 * 1024,
        smem_reserved_per_cta: 1024,
        regs_per_sm: 65536,
    };

    /// The target of compute capability `major.minor`: Hopper's own, else
    /// the portable one with that GPU's shared memory per SM.
    pub fn for_sm(major: u32, minor: u32) -> Target {
        let smem_kib = match (major, minor) {
            (9, 0) => return Target::HOPPER,
            (8, 0) | (8, 7) => 164,
            (8, _) | (12, _) => 100,
            _ => 228,
        };
        Target { sm: (major, minor), smem_per_sm: smem_kib * 1024, ..Target::PORTABLE }
    }

    /// The target a kernel written in `mma` is generated for: wgmma exists
    /// on sm_90a alone.
    pub(crate) fn of_mma(mma: Mma) -> Target {
        match mma {
            Mma::Sync => Target::PORTABLE,
            Mma::Wgmma => Target::HOPPER,
        }
    }
}

/// Head dims round up to the MMA k-step (and to pairs of 8-wide n-tiles).
pub(crate) fn pad16(d: u32) -> u32 {
    d.div_ceil(16) * 16
}
