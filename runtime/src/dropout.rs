//! Dropout as a launch option ([`ForwardOptions::dropout`](crate::ForwardOptions::dropout),
//! [`BackwardOptions::dropout`](crate::BackwardOptions::dropout)): its
//! checks, and the launches that refuse it.

use crate::dropout_error::DropoutError;
use crate::error::Error;
use flashgen_codegen::Dropout;

/// A launch's dropout, checked: `None` without one or with `p = 0`, which
/// run the kernels without dropout (the same result, and no Philox).
pub(crate) fn checked(dropout: Option<Dropout>) -> Result<Option<Dropout>, Error> {
    match dropout {
        Some(d) if !d.is_valid() => Err(Error::Dropout(DropoutError::Probability { p: d.p })),
        Some(d) if d.p > 0.0 => Ok(Some(d)),
        _ => Ok(None),
    }
}

/// An error where a `launch` without dropout kernels is asked for dropout
/// (`p = 0` is no dropout, so it passes).
pub(crate) fn refuse(dropout: Option<Dropout>, launch: &'static str) -> Result<(), Error> {
    match checked(dropout)? {
        Some(_) => Err(Error::Dropout(DropoutError::Unsupported { launch })),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_outside_zero_to_one_are_typed_errors() {
        let d = |p| Some(Dropout { p, seed: 1, offset: 2 });
        assert!(checked(None).unwrap().is_none());
        assert!(checked(d(0.0)).unwrap().is_none(), "p = 0 is no dropout");
        assert_eq!(checked(d(0.25)).unwrap(), d(0.25));
        for p in [1.0, 1.5, -0.1, f32::NAN, f32::INFINITY] {
            let err = checked(d(p)).unwrap_err();
            assert!(matches!(err, Error::Dropout(DropoutError::Probability { .. })), "{err}");
        }
        refuse(d(0.0), "varlen").unwrap();
        let err = refuse(d(0.1), "varlen").unwrap_err();
        assert!(matches!(err, Error::Dropout(DropoutError::Unsupported { launch: "varlen" })), "{err}");
        assert!(err.to_string().starts_with("dropout: varlen launches have none"), "{err}");
    }
}
