//! Delimiter balance, checked when the lexer rejects a spec's text: the
//! lexer says only "cannot parse string into token stream", so an unclosed
//! `{` or a stray `)` is found here and named with where it opened.

use crate::error::SpecError;
use proc_macro2::{Span, TokenStream};

/// A character of code (not inside a comment, string or character literal)
/// with its 1-based line and column.
struct Located {
    ch: char,
    line: usize,
    col: usize,
}

/// The first delimiter of `source` that does not balance, as an error at
/// that delimiter; `None` when `()`, `[]` and `{}` all balance.
pub(super) fn unbalanced(source: &str) -> Option<SpecError> {
    let mut open: Vec<Located> = Vec::new();
    for c in code_chars(source) {
        match c.ch {
            '(' | '[' | '{' => open.push(c),
            ')' | ']' | '}' => match open.pop() {
                Some(o) if closer(o.ch) == c.ch => {}
                Some(o) => {
                    let message = format!(
                        "`{}` does not close `{}` opened at {}:{} (expected `{}`)",
                        c.ch,
                        o.ch,
                        o.line,
                        o.col,
                        closer(o.ch)
                    );
                    return Some(SpecError::new(span_at(c.line, c.col), message));
                }
                None => {
                    return Some(SpecError::new(
                        span_at(c.line, c.col),
                        format!("unexpected `{}`: nothing is open here", c.ch),
                    ))
                }
            },
            _ => {}
        }
    }
    open.pop().map(|o| {
        let message =
            format!("unclosed `{}` opened at {}:{}: no `{}` before the end", o.ch, o.line, o.col, closer(o.ch));
        SpecError::new(span_at(o.line, o.col), message)
    })
}

fn closer(open: char) -> char {
    match open {
        '(' => ')',
        '[' => ']',
        _ => '}',
    }
}

/// The characters of `source` outside `//` and (nested) `/* */` comments,
/// string literals and character literals, located.
fn code_chars(source: &str) -> Vec<Located> {
    let chars: Vec<char> = source.chars().collect();
    let (mut line, mut col, mut i) = (1, 1, 0);
    let mut code = Vec::new();
    while i < chars.len() {
        let n = match (chars[i], chars.get(i + 1).copied()) {
            ('/', Some('/')) => chars[i..].iter().position(|&c| c == '\n').unwrap_or(chars.len() - i),
            ('/', Some('*')) => block_comment_len(&chars[i..]),
            ('"', _) => quoted_len(&chars[i..], '"'),
            ('\'', Some('\\')) => quoted_len(&chars[i..], '\''),
            ('\'', _) if chars.get(i + 2) == Some(&'\'') => 3,
            (ch, _) => {
                code.push(Located { ch, line, col });
                1
            }
        };
        // Past the `n` characters just read, keeping line and column.
        for &c in &chars[i..(i + n).min(chars.len())] {
            (line, col) = if c == '\n' { (line + 1, 1) } else { (line, col + 1) };
        }
        i += n;
    }
    code
}

/// Length of the (possibly nested, possibly unterminated) block comment at
/// the start of `text`.
fn block_comment_len(text: &[char]) -> usize {
    let (mut depth, mut i) = (0usize, 0);
    while i < text.len() {
        match (text[i], text.get(i + 1)) {
            ('/', Some('*')) => (depth, i) = (depth + 1, i + 2),
            ('*', Some('/')) => {
                (depth, i) = (depth - 1, i + 2);
                if depth == 0 {
                    return i;
                }
            }
            _ => i += 1,
        }
    }
    text.len()
}

/// Length of the literal quoted by `quote` at the start of `text`, escapes
/// included (to the end when unterminated).
fn quoted_len(text: &[char], quote: char) -> usize {
    let mut i = 1;
    while i < text.len() {
        match text[i] {
            '\\' => i += 2,
            c if c == quote => return i + 1,
            _ => i += 1,
        }
    }
    text.len()
}

/// A span at 1-based `line` and `col`: the lexer locates spans only in text
/// it lexed, so it lexes a placeholder token at that position.
fn span_at(line: usize, col: usize) -> Span {
    let placeholder = format!("{}{}x", "\n".repeat(line - 1), " ".repeat(col - 1));
    let token = placeholder.parse::<TokenStream>().ok().and_then(|t| t.into_iter().next());
    token.map_or_else(Span::call_site, |t| t.span())
}
