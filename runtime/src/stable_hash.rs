//! A hash whose value is fixed across processes and Rust versions, for the
//! names of files the disk cache keeps (kernels and tuning records).

/// FNV-1a 128: tiny, and unlike `std`'s `DefaultHasher` its output is fixed
/// across processes and Rust versions, which a key stored on disk needs. 128
/// bits make an accidental collision (loading the wrong kernel) negligible.
#[derive(Clone, Copy)]
pub(crate) struct Fnv1a(pub(crate) u128);

impl Fnv1a {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013b;

    pub(crate) fn new() -> Fnv1a {
        Fnv1a(Self::OFFSET)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u128::from(b)).wrapping_mul(Self::PRIME);
        }
    }

    /// Writes `bytes` length-prefixed, so that no two different lists of
    /// fields hash the same bytes.
    pub(crate) fn field(&mut self, bytes: &[u8]) {
        self.write(&(bytes.len() as u64).to_le_bytes());
        self.write(bytes);
    }

    /// The hash of `bytes` alone.
    pub(crate) fn of(bytes: &[u8]) -> u128 {
        let mut h = Fnv1a::new();
        h.write(bytes);
        h.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_128_matches_the_reference_vectors() {
        assert_eq!(Fnv1a::of(b""), Fnv1a::OFFSET);
        assert_eq!(Fnv1a::of(b"a"), 0xd228cb696f1a8caf78912b704e4a8964);
        assert_eq!(Fnv1a::of(b"foobar"), 0x343e1662793c64bf6f0d3597ba446f18);
    }

    #[test]
    fn fields_are_length_prefixed() {
        let hash = |fields: &[&[u8]]| {
            let mut h = Fnv1a::new();
            fields.iter().for_each(|f| h.field(f));
            h.0
        };
        assert_ne!(hash(&[b"ab", b"c"]), hash(&[b"a", b"bc"]));
    }
}
