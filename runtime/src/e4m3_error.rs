//! What an e4m3 forward launch can get wrong ([`E4m3Error`], inside
//! [`crate::Error::E4m3`]).

use crate::arch::Arch;
use std::fmt;

/// An e4m3 forward that cannot run.
#[derive(Debug)]
pub enum E4m3Error {
    /// The e4m3 forward runs on Hopper's 8-bit wgmma (sm_90) only.
    Arch { arch: Arch },
    /// No tile configuration runs the spec on e4m3 operands (`reason`), or
    /// the one the launch named cannot.
    Config { spec: String, reason: String },
    /// An operand the copy engine cannot address: its address and its
    /// strides must be multiples of 16 bytes (and each stride under 2^40
    /// bytes, each size under 2^32).
    Unaligned { operand: &'static str },
}

impl fmt::Display for E4m3Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            E4m3Error::Arch { arch } => {
                write!(f, "the e4m3 forward needs Hopper's 8-bit tensor cores (sm_90); this GPU is {arch}")
            }
            E4m3Error::Config { spec, reason } => write!(f, "spec `{spec}` has no e4m3 forward here: {reason}"),
            E4m3Error::Unaligned { operand } => write!(
                f,
                "the e4m3 forward copies {operand} with TMA: its address and its batch, sequence and head \
                 strides must be multiples of 16 bytes, each stride under 2^40 bytes and each size under 2^32"
            ),
        }
    }
}
