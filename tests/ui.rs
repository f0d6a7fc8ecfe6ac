//! Pins the `attention!` macro's error messages and spans.
//! Re-bless after an intended change with `TRYBUILD=overwrite cargo test --test ui`.

#[test]
fn spec_errors_are_spanned_compile_errors() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
