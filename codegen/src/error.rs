//! Spanned spec errors, shared by the macro (spans become `compile_error!`s)
//! and by run-time parsing of strings and `.attn` files (spans become
//! `line:column` with a caret under the offending text).

use proc_macro2::Span;
use std::fmt;

/// A problem in a spec, located at the tokens that caused it.
#[derive(Clone, Debug)]
pub struct SpecError {
    pub span: Span,
    pub message: String,
}

impl SpecError {
    pub fn new(span: Span, message: impl Into<String>) -> Self {
        SpecError { span, message: message.into() }
    }

    /// 1-based line and column of the error's start, when the span carries
    /// locations (always for strings parsed at run time).
    pub fn line_col(&self) -> (usize, usize) {
        let start = self.span.start();
        (start.line, start.column + 1)
    }

    /// Renders `file:line:col: error: message` followed by the source line
    /// and a caret under the span, rustc style.
    pub fn render(&self, file: &str, source: &str) -> String {
        let (line, col) = self.line_col();
        let mut out = format!("{file}:{line}:{col}: error: {}", self.message);
        if let Some(text) = source.lines().nth(line.saturating_sub(1)) {
            let end = self.span.end();
            let width = if end.line == line && end.column + 1 > col { end.column + 1 - col } else { 1 };
            out.push_str(&format!("\n{line:>4} | {text}\n     | {}{}", " ".repeat(col - 1), "^".repeat(width)));
        }
        out
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (line, col) = self.line_col();
        write!(f, "{line}:{col}: {}", self.message)
    }
}

impl std::error::Error for SpecError {}

impl From<syn::Error> for SpecError {
    fn from(e: syn::Error) -> Self {
        SpecError::new(e.span(), e.to_string())
    }
}

/// Shorthand for returning a spanned error.
pub(crate) fn err<T>(span: Span, message: impl Into<String>) -> Result<T, SpecError> {
    Err(SpecError::new(span, message))
}
