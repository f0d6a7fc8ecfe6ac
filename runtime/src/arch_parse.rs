//! Reading an [`Arch`] from text (`sm_90`, `sm_90a`, `90`), as the CLI and
//! the precompile list take it; a bad one is [`Error::InvalidArch`].

use crate::arch::Arch;
use crate::error::Error;
use std::str::FromStr;

/// Parses `sm_90`, `sm_90a` or `90` (the last digit is the minor version, so
/// `sm_100` is 10.0). Arch-specific suffixes are accepted and dropped: the
/// runtime always compiles for exactly the device it runs on.
impl FromStr for Arch {
    type Err = Error;

    fn from_str(s: &str) -> Result<Arch, Error> {
        let invalid = || Error::InvalidArch { input: s.to_string() };
        let digits = s.strip_prefix("sm_").unwrap_or(s);
        let digits = digits.strip_suffix(['a', 'f']).unwrap_or(digits);
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        Ok(Arch { major: major.parse().map_err(|_| invalid())?, minor: minor.parse().map_err(|_| invalid())? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (text, arch) in [
            ("sm_90", Arch::new(9, 0)),
            ("sm_90a", Arch::new(9, 0)),
            ("90", Arch::new(9, 0)),
            ("sm_86", Arch::new(8, 6)),
            ("sm_100a", Arch::new(10, 0)),
            ("120", Arch::new(12, 0)),
        ] {
            assert_eq!(text.parse::<Arch>().unwrap(), arch, "{text}");
        }
        assert_eq!(Arch::new(9, 0).to_string(), "sm_90");
        assert_eq!(Arch::new(10, 0).to_string(), "sm_100");
        assert!(Arch::new(8, 6) < Arch::new(9, 0) && Arch::new(9, 0) < Arch::new(10, 0));
    }

    #[test]
    fn rejects_garbage() {
        for text in ["", "sm_", "sm_9", "9", "sm_9x", "compute_90", "sm_90b", "+90", "sm_99999999999"] {
            let err = text.parse::<Arch>().unwrap_err();
            assert!(matches!(&err, Error::InvalidArch { input } if input == text), "{text}: {err}");
            assert!(err.to_string().contains("sm_90"), "{err}");
        }
    }
}
