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

/// What the GPU a kernel is generated for offers beyond sm_80.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// `wgmma` (compute capability 9.0, compiled as sm_90a).
    pub wgmma: bool,
}

impl Target {
    /// Any sm_80-class GPU.
    pub const PORTABLE: Target = Target { wgmma: false };

    /// The target of compute capability `major.minor`.
    pub fn for_sm(major: u32, minor: u32) -> Target {
        Target { wgmma: (major, minor) == (9, 0) }
    }
}

/// Head dims round up to the MMA k-step (and to pairs of 8-wide n-tiles).
pub(crate) fn pad16(d: u32) -> u32 {
    d.div_ceil(16) * 16
}
