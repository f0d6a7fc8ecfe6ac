//! An indenting writer over [`fmt::Write`], in the manner of naga's backends.
//!
//! Emitters write whole lines with `writeln!` and open scopes with
//! [`Writer::block`]; the writer prefixes each non-empty line with the current
//! indentation, so multi-line text (the prelude) passes through verbatim and
//! nested code never tracks its own depth.

use std::fmt::{self, Write};

const INDENT: &str = "    ";

pub(crate) struct Writer<W> {
    out: W,
    level: usize,
    /// Whether the next character starts a line (and so needs indentation).
    line_start: bool,
}

impl<W: Write> Writer<W> {
    pub fn new(out: W) -> Self {
        Writer { out, level: 0, line_start: true }
    }

    pub fn into_inner(self) -> W {
        self.out
    }

    /// Runs `body` one indentation level deeper.
    pub fn indented(&mut self, body: impl FnOnce(&mut Self) -> fmt::Result) -> fmt::Result {
        self.level += 1;
        let result = body(self);
        self.level -= 1;
        result
    }

    /// Writes `head {`, then `body` one level deeper, then `}`.
    pub fn block(&mut self, head: fmt::Arguments, body: impl FnOnce(&mut Self) -> fmt::Result) -> fmt::Result {
        writeln!(self, "{head} {{")?;
        self.indented(body)?;
        writeln!(self, "}}")
    }
}

impl<W: Write> Write for Writer<W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for piece in s.split_inclusive('\n') {
            // Blank lines stay empty: no trailing whitespace in the output.
            if self.line_start && piece != "\n" {
                for _ in 0..self.level {
                    self.out.write_str(INDENT)?;
                }
            }
            self.out.write_str(piece)?;
            self.line_start = piece.ends_with('\n');
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indents_nested_blocks_and_keeps_blank_lines_empty() {
        let mut w = Writer::new(String::new());
        w.block(format_args!("if (a)"), |w| {
            write!(w, "x = ")?;
            writeln!(w, "1;\n")?;
            w.block(format_args!("for (;;)"), |w| w.write_str("y;\nz;\n"))
        })
        .unwrap();
        assert_eq!(w.into_inner(), "if (a) {\n    x = 1;\n\n    for (;;) {\n        y;\n        z;\n    }\n}\n");
    }
}
