//! GPU compute capabilities (`sm_XY`), the unit NVRTC compiles for.
//! Parsing one from text, which fails with an `Error`, is in `arch_parse`.

use flashgen_codegen::cuda::Target;
use std::fmt;

/// A compute capability, e.g. `sm_90` = 9.0. Ordered by major, then minor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
}

impl Arch {
    /// The oldest GPU the kernels support: bf16 tensor-core MMA needs Ampere.
    pub const MIN: Arch = Arch { major: 8, minor: 0 };

    pub const fn new(major: u32, minor: u32) -> Arch {
        Arch { major, minor }
    }

    /// What kernels compiled for this arch may use beyond sm_80.
    pub fn target(self) -> Target {
        Target::for_sm(self.major, self.minor)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}
