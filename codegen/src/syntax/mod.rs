//! The front end: the spec grammar, shared by the `attention!` macro and by
//! `.attn` files and strings parsed at run time.
//!
//! Both paths parse `proc_macro2` tokens with `syn`, so a spec means exactly
//! the same thing wherever it is written, and every error carries a span
//! (a compiler span in the macro, a line and column for strings). Parsing
//! never panics: anything unexpected is a [`SpecError`].
//!
//! ```text
//! /// Doc comment.
//! pub Name {
//!     dtype: bf16, head_dim: 128, v_head_dim: 128,
//!     param window: i32,
//!     tensor slopes: f32[H],
//!     mask: q >= k && q - k < window,
//!     score: score + slopes[h] * (k - q) as f32,
//!     sink: sinks[h],
//! }
//! ```

mod check;
mod delimiters;
mod dims;
mod print;

use crate::error::{err, SpecError};
use crate::spec::{Dtype, ElemTy, HeadDims, Param, Spec, TensorDecl, Ty, MAX_DECODE_HEAD_DIM};
use proc_macro2::{Span, TokenStream, TokenTree};
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{braced, bracketed, Attribute, Ident, LitInt, Token};

pub use print::{expr_source, to_source};

/// Parses and checks every spec in `source` (the text of an `.attn` file).
pub fn parse_str(source: &str) -> Result<Vec<Spec>, SpecError> {
    let tokens: TokenStream = source.parse().map_err(|e: proc_macro2::LexError| {
        delimiters::unbalanced(source).unwrap_or_else(|| SpecError::new(e.span(), format!("invalid token: {e}")))
    })?;
    parse_tokens(tokens)
}

/// Parses and checks every spec in a token stream (the body of `attention!`).
pub fn parse_tokens(tokens: TokenStream) -> Result<Vec<Spec>, SpecError> {
    reject_tilde(tokens.clone())?;
    let file: SpecFile = syn::parse2(tokens)?;
    let mut specs: Vec<Spec> = Vec::new();
    for ast in file.0 {
        if specs.iter().any(|s| ast.name == s.name) {
            return err(ast.name.span(), format!("spec `{}` is defined twice", ast.name));
        }
        specs.push(lower_spec(ast)?);
    }
    if specs.is_empty() {
        return err(Span::call_site(), "expected at least one spec: `Name { dtype: bf16, head_dim: 128, ... }`");
    }
    Ok(specs)
}

/// C's `~` is no Rust operator (syn would only say "expected an
/// expression"): point C users at `!`.
fn reject_tilde(tokens: TokenStream) -> Result<(), SpecError> {
    for tree in tokens {
        match tree {
            TokenTree::Punct(p) if p.as_char() == '~' => {
                return err(p.span(), "`~` is not an operator here: bitwise not is `!` on i32, as in Rust")
            }
            TokenTree::Group(g) => reject_tilde(g.stream())?,
            _ => {}
        }
    }
    Ok(())
}

/// Parses a source holding exactly one spec.
pub fn parse_one(source: &str) -> Result<Spec, SpecError> {
    let mut specs = parse_str(source)?;
    if specs.len() > 1 {
        return err(Span::call_site(), format!("expected one spec, found {}", specs.len()));
    }
    Ok(specs.remove(0))
}

struct SpecFile(Vec<SpecAst>);

struct SpecAst {
    attrs: Vec<Attribute>,
    public: bool,
    name: Ident,
    fields: Vec<FieldAst>,
    body_span: Span,
}

enum FieldAst {
    Setting { key: Ident, value: syn::Expr },
    Param { name: Ident, ty: Ident },
    Tensor { name: Ident, elem: Ident, dims: Vec<syn::Expr> },
}

impl Parse for SpecFile {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut specs = Vec::new();
        while !input.is_empty() {
            specs.push(input.parse()?);
        }
        Ok(SpecFile(specs))
    }
}

impl Parse for SpecAst {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let public = input.parse::<Option<Token![pub]>>()?.is_some();
        let name: Ident = input.parse()?;
        let body;
        let brace = braced!(body in input);
        let fields = body.parse_terminated(FieldAst::parse, Token![,])?;
        Ok(SpecAst { attrs, public, name, fields: fields.into_iter().collect(), body_span: brace.span.join() })
    }
}

impl Parse for FieldAst {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let key: Ident = input.call(syn::ext::IdentExt::parse_any)?;
        let declares = key == "param" || key == "tensor";
        if declares && input.peek(Ident) {
            let name: Ident = input.parse()?;
            input.parse::<Token![:]>()?;
            let ty: Ident = input.parse()?;
            if key == "param" {
                return Ok(FieldAst::Param { name, ty });
            }
            let dims;
            bracketed!(dims in input);
            let dims = dims.parse_terminated(syn::Expr::parse, Token![,])?;
            return Ok(FieldAst::Tensor { name, elem: ty, dims: dims.into_iter().collect() });
        }
        input.parse::<Token![:]>()?;
        Ok(FieldAst::Setting { key, value: input.parse()? })
    }
}

/// Builder state while lowering one spec's fields.
#[derive(Default)]
struct Fields {
    dtype: Option<Dtype>,
    head_dim: Option<u32>,
    v_head_dim: Option<u32>,
    mask: Option<syn::Expr>,
    score: Option<syn::Expr>,
    sink: Option<syn::Expr>,
    params: Vec<Param>,
    tensors: Vec<TensorDecl>,
    seen: Vec<String>,
}

impl Fields {
    /// Rejects a second use of any name; `declared` names (params and
    /// tensors) may not shadow built-ins or take a setting's name.
    fn claim(&mut self, name: &Ident, declared: bool) -> Result<(), SpecError> {
        let text = plain_name(name)?;
        if declared && (check::is_reserved(&text) || SETTINGS.contains(&text.as_str())) {
            return err(name.span(), format!("`{text}` is a built-in name and cannot be redeclared"));
        }
        if self.seen.contains(&text) {
            return err(name.span(), format!("`{text}` is given twice"));
        }
        self.seen.push(text);
        Ok(())
    }
}

const SETTINGS: [&str; 6] = ["dtype", "head_dim", "v_head_dim", "mask", "score", "sink"];

/// Names become C identifiers and kernel symbols: ASCII only, no `r#`.
fn plain_name(name: &Ident) -> Result<String, SpecError> {
    let text = name.to_string();
    if text.starts_with("r#") || !text.is_ascii() {
        return err(name.span(), format!("`{text}`: names must be plain ASCII identifiers"));
    }
    Ok(text)
}

fn lower_spec(ast: SpecAst) -> Result<Spec, SpecError> {
    let name = plain_name(&ast.name)?;
    let mut f = Fields::default();
    for field in ast.fields {
        match field {
            FieldAst::Param { name, ty } => {
                f.claim(&name, true)?;
                let ty = match ty.to_string().as_str() {
                    "i32" => Ty::I32,
                    "f32" => Ty::F32,
                    other => return err(ty.span(), format!("unknown param type `{other}`: expected `i32` or `f32`")),
                };
                f.params.push(Param { name: name.to_string(), ty });
            }
            FieldAst::Tensor { name, elem, dims } => {
                f.claim(&name, true)?;
                f.tensors.push(lower_tensor(&name, &elem, &dims, &f.params)?);
            }
            FieldAst::Setting { key, value } => {
                f.claim(&key, false)?;
                lower_setting(&mut f, &key, value)?;
            }
        }
    }
    let Some(dtype) = f.dtype else {
        return err(ast.body_span, "missing `dtype: f16` or `dtype: bf16`");
    };
    let Some(qk) = f.head_dim else {
        return err(ast.body_span, "missing `head_dim: <1..=576>`");
    };
    let head_dims = HeadDims { qk, v: f.v_head_dim.unwrap_or(qk) };
    let scope = check::Scope { params: &f.params, tensors: &f.tensors };
    let mask = f.mask.as_ref().map(|e| scope.check(e, check::Role::Mask)).transpose()?;
    let score = f.score.as_ref().map(|e| scope.check(e, check::Role::Score)).transpose()?;
    let sink = f.sink.as_ref().map(|e| scope.check(e, check::Role::Sink)).transpose()?;
    Ok(Spec {
        name,
        doc: doc_lines(&ast.attrs)?,
        public: ast.public,
        dtype,
        head_dims,
        params: f.params,
        tensors: f.tensors,
        mask,
        score,
        sink,
    })
}

fn lower_setting(f: &mut Fields, key: &Ident, value: syn::Expr) -> Result<(), SpecError> {
    match key.to_string().as_str() {
        "dtype" => {
            f.dtype = Some(match path_ident(&value).as_deref() {
                Some("f16") => Dtype::F16,
                Some("bf16") => Dtype::Bf16,
                _ => return err(value.span(), "unknown dtype: expected `f16` or `bf16`"),
            })
        }
        "head_dim" => f.head_dim = Some(head_dim(&value)?),
        "v_head_dim" => f.v_head_dim = Some(head_dim(&value)?),
        "mask" => f.mask = Some(value),
        "score" => f.score = Some(value),
        "sink" => f.sink = Some(value),
        other => {
            return err(
                key.span(),
                format!(
                    "unknown field `{other}`: expected one of `dtype`, `head_dim`, `v_head_dim`, `mask`, `score`, `sink`, `param NAME: TYPE`, `tensor NAME: TYPE[DIMS]`"
                ),
            )
        }
    }
    Ok(())
}

fn lower_tensor(name: &Ident, elem: &Ident, dims: &[syn::Expr], params: &[Param]) -> Result<TensorDecl, SpecError> {
    let elem_ty = match elem.to_string().as_str() {
        "i32" => ElemTy::I32,
        "f32" => ElemTy::F32,
        "f16" => ElemTy::F16,
        "bf16" => ElemTy::Bf16,
        other => {
            return err(
                elem.span(),
                format!("unknown tensor element type `{other}`: expected `i32`, `f32`, `f16` or `bf16`"),
            )
        }
    };
    if dims.is_empty() || dims.len() > 3 {
        return err(name.span(), format!("tensor `{name}` has {} dimensions: expected 1 to 3", dims.len()));
    }
    let dims = dims.iter().map(|d| dims::lower_dim(d, params)).collect::<Result<_, _>>()?;
    Ok(TensorDecl { name: name.to_string(), elem: elem_ty, dims })
}

fn head_dim(value: &syn::Expr) -> Result<u32, SpecError> {
    let syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(lit), .. }) = value else {
        let message = match negative_int(value) {
            Some(lit) => format!("unsupported head dimension -{lit}: expected 1 to {MAX_DECODE_HEAD_DIM}"),
            None => format!("a head dimension must be an integer literal from 1 to {MAX_DECODE_HEAD_DIM}"),
        };
        return err(value.span(), message);
    };
    match lit.base10_parse::<u32>() {
        Ok(d) if lit.suffix().is_empty() && (1..=MAX_DECODE_HEAD_DIM).contains(&d) => Ok(d),
        _ => err(lit.span(), format!("unsupported head dimension {lit}: expected 1 to {MAX_DECODE_HEAD_DIM}")),
    }
}

/// The literal of `-<integer literal>`.
fn negative_int(e: &syn::Expr) -> Option<&LitInt> {
    let syn::Expr::Unary(syn::ExprUnary { op: syn::UnOp::Neg(_), expr, .. }) = e else { return None };
    match &**expr {
        syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(lit), .. }) => Some(lit),
        _ => None,
    }
}

fn path_ident(e: &syn::Expr) -> Option<String> {
    match e {
        syn::Expr::Path(p) if p.qself.is_none() => p.path.get_ident().map(|i| i.to_string()),
        _ => None,
    }
}

fn doc_lines(attrs: &[Attribute]) -> Result<Vec<String>, SpecError> {
    attrs
        .iter()
        .map(|a| match &a.meta {
            syn::Meta::NameValue(nv) if nv.path.is_ident("doc") => match &nv.value {
                syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) => {
                    Ok(s.value().lines().map(|l| l.trim().to_string()).collect::<Vec<_>>())
                }
                other => err(other.span(), "expected a doc string"),
            },
            _ => err(a.span(), "only `///` doc comments may precede a spec"),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|lines| lines.concat())
}
