//! The `attention!` macro: a thin shell over `flashgen-codegen`.
//!
//! Parsing and checking live in the ordinary library (`flashgen_codegen::
//! parse_tokens`), which never panics and returns spanned errors; this crate
//! only turns those errors into `compile_error!`s and emits the typed Rust API
//! of each spec. The spec itself travels as its canonical source text, so the
//! run-time `Spec` is exactly the one checked here.

mod expand;

use proc_macro::TokenStream;

/// Defines one or more attention variants and their typed launch API.
///
/// ```ignore
/// flashgen::attention! {
///     /// Causal sliding window with ALiBi.
///     pub SlidingAlibi {
///         dtype: bf16, head_dim: 128,
///         param window: i32,
///         tensor slopes: f32[H],
///         mask: q >= k && q - k < window,
///         score: score + slopes[h] * (k - q) as f32,
///     }
/// }
/// ```
///
/// For each spec `Name` this generates a unit struct `Name` with `spec()`,
/// `SOURCE`, `kernel()` and `forward(..)`, and a `NameArgs` struct holding the
/// declared params and captured tensors.
#[proc_macro]
pub fn attention(input: TokenStream) -> TokenStream {
    match flashgen_codegen::parse_tokens(input.into()) {
        Ok(specs) => specs.iter().map(expand::spec_items).collect::<proc_macro2::TokenStream>().into(),
        Err(e) => syn::Error::new(e.span, e.message).to_compile_error().into(),
    }
}
