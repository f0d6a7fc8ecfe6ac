//! Rust items generated for one checked spec.
//!
//! Everything dtype- or declaration-specific is fixed by the types here (the
//! element type of Q/K/V/O, each param's scalar type, each tensor's element
//! type), so most launch mistakes are compile errors; the runtime checks the
//! rest (shapes, strides, buffer sizes).

use flashgen_codegen::{Dtype, ElemTy, Spec, Ty};
use proc_macro2::{Ident, TokenStream};
use quote::{format_ident, quote};

pub fn spec_items(spec: &Spec) -> TokenStream {
    let name = format_ident!("{}", spec.name);
    let args_name = format_ident!("{}Args", spec.name);
    let vis = if spec.public { quote!(pub) } else { quote!() };
    let source = flashgen_codegen::to_source(spec);
    let docs = spec.doc.iter().map(|line| quote!(#[doc = #line]));
    let elem = match spec.dtype {
        Dtype::F16 => quote!(::flashgen::half::f16),
        Dtype::Bf16 => quote!(::flashgen::half::bf16),
    };

    let values = spec
        .params
        .iter()
        .map(|p| format_ident!("{}", p.name))
        .chain(spec.tensors.iter().map(|t| format_ident!("{}", t.name)))
        .map(|f| quote!(::flashgen::ArgValue::from(args.#f)));

    let has_fields = !(spec.params.is_empty() && spec.tensors.is_empty());
    let (args_def, args_ty) = args_struct(spec, &vis, &args_name);
    let args_doc = format!("Runtime params and captured tensors of [`{}`].", spec.name);
    let unused = if has_fields { quote!() } else { quote!(let _ = args;) };
    let values: Vec<TokenStream> = values.collect();
    let block_mask = spec.mask.as_ref().map(|_| {
        quote! {
            /// Builds the tile classes of this spec's mask for launches of
            /// `shape` with `args` (see [`::flashgen::Runtime::block_mask`]);
            /// pass it in [`::flashgen::ForwardOptions::block_mask`].
            pub fn block_mask(
                rt: &::flashgen::Runtime,
                shape: ::flashgen::Shape,
                args: &#args_ty,
            ) -> ::std::result::Result<::flashgen::BlockMask, ::flashgen::Error> {
                #unused
                rt.block_mask(Self::spec(), shape, &[#(#values),*])
            }
        }
    });
    let launches = LAUNCHES.iter().map(|launch| launch.method(&elem, &args_ty, &unused, &values));
    let expect_msg = format!("spec `{}` was checked by attention! at compile time", spec.name);
    let spec_fn = quote!(
        /// The checked spec, parsed once from [`Self::SOURCE`].
        pub fn spec() -> &'static ::flashgen::Spec {
            static SPEC: ::std::sync::OnceLock<::flashgen::Spec> = ::std::sync::OnceLock::new();
            // Cannot fail: SOURCE is the canonical print of a spec that
            // attention! already parsed and checked.
            SPEC.get_or_init(|| ::flashgen::parse_one(Self::SOURCE).expect(#expect_msg))
        }
    );

    quote! {
        #(#docs)*
        #[derive(Clone, Copy, Debug, Default)]
        #vis struct #name;

        #[doc = #args_doc]
        #[derive(Clone, Copy, Debug)]
        #args_def

        impl #name {
            /// The spec in canonical `.attn` syntax.
            pub const SOURCE: &'static str = #source;

            #spec_fn

            /// The generated forward kernel (CUDA source and launch contract).
            pub fn kernel() -> ::flashgen::codegen::abi::Kernel {
                ::flashgen::codegen::cuda::emit_forward(Self::spec())
            }

            #(#launches)*

            /// Appends new K/V rows to paged caches this spec's paged forward
            /// reads (see [`::flashgen::Runtime::append_paged`]).
            pub fn append_paged(
                rt: &::flashgen::Runtime,
                append: ::flashgen::PagedAppend<'_, #elem>,
            ) -> ::std::result::Result<(), ::flashgen::Error> {
                rt.append_paged(Self::spec(), append)
            }

            #block_mask
        }
    }
}

/// A typed wrapper of a `Runtime` launch: `rt.<name>(Self::spec(), io,
/// &[args…], opts)`.
struct Launch {
    name: &'static str,
    doc: &'static str,
    /// The io type, generic over the element type.
    io: &'static str,
    options: &'static str,
    /// What the launch returns in `Ok`.
    output: &'static str,
}

const LAUNCHES: [Launch; 7] = [
    Launch {
        name: "forward",
        doc: "Launches the forward pass on `rt`'s stream after checking every shape, stride and buffer size \
              against the spec.",
        io: "ForwardIo",
        options: "ForwardOptions",
        output: "()",
    },
    Launch {
        name: "forward_varlen",
        doc: "Launches the forward pass on packed (varlen) sequences on `rt`'s stream: `b` is the sequence, \
              `q_len` / `kv_len` its lengths (see [`::flashgen::Runtime::forward_varlen`]).",
        io: "VarlenIo",
        options: "ForwardOptions",
        output: "()",
    },
    Launch {
        name: "forward_paged",
        doc: "Launches the forward pass over paged K/V caches on `rt`'s stream: `b` is the sequence, \
              `q_len` / `kv_len` its lengths (see [`::flashgen::Runtime::forward_paged`]).",
        io: "PagedIo",
        options: "ForwardOptions",
        output: "()",
    },
    Launch {
        name: "autotune",
        doc: "Times every tile configuration of the forward on these operands and remembers the fastest for \
              their shape class (see [`::flashgen::Runtime::autotune`]). A forward pass: writes O and the LSE.",
        io: "ForwardIo",
        options: "ForwardOptions",
        output: "::flashgen::TuneReport",
    },
    Launch {
        name: "backward",
        doc: "Launches the backward pass on `rt`'s stream: dQ, dK, dV and the requested tensor gradients from \
              the forward's O and LSE, with the same checks as [`Self::forward`] plus the gradient operands'.",
        io: "BackwardIo",
        options: "BackwardOptions",
        output: "()",
    },
    Launch {
        name: "autotune_backward",
        doc: "Times every dK/dV tile of the backward on these operands and remembers the fastest for their \
              shape class (see [`::flashgen::Runtime::autotune_backward`]). Backward passes: write dQ, dK, dV \
              and the requested tensor gradients.",
        io: "BackwardIo",
        options: "BackwardOptions",
        output: "::flashgen::TuneReport<::flashgen::codegen::cuda::BackwardTile>",
    },
    Launch {
        name: "backward_varlen",
        doc: "Launches the backward pass on packed (varlen) sequences on `rt`'s stream: the gradients of \
              [`Self::forward_varlen`] (see [`::flashgen::Runtime::backward_varlen`]).",
        io: "VarlenBackwardIo",
        options: "BackwardOptions",
        output: "()",
    },
];

impl Launch {
    fn method(
        &self,
        elem: &TokenStream,
        args_ty: &TokenStream,
        unused: &TokenStream,
        values: &[TokenStream],
    ) -> TokenStream {
        let [name, io, options] = [self.name, self.io, self.options].map(|s| format_ident!("{s}"));
        let output: TokenStream = self.output.parse().expect("a Rust type");
        let doc = self.doc;
        quote! {
            #[doc = #doc]
            pub fn #name(
                rt: &::flashgen::Runtime,
                io: ::flashgen::#io<'_, #elem>,
                args: &#args_ty,
                opts: &::flashgen::#options<'_>,
            ) -> ::std::result::Result<#output, ::flashgen::Error> {
                #unused
                rt.#name(Self::spec(), io, &[#(#values),*], opts)
            }
        }
    }
}

/// The `…Args` struct (one field per param and captured tensor, or a unit
/// struct) and the type a launch takes it as.
fn args_struct(spec: &Spec, vis: &TokenStream, args_name: &Ident) -> (TokenStream, TokenStream) {
    let param_fields = spec.params.iter().map(|p| {
        let field = format_ident!("{}", p.name);
        let ty = match p.ty {
            Ty::I32 => quote!(i32),
            _ => quote!(f32),
        };
        let doc = format!("Runtime param `{}: {}`.", p.name, p.ty);
        quote!(#[doc = #doc] pub #field: #ty)
    });
    let tensor_fields = spec.tensors.iter().map(|t| {
        let field = format_ident!("{}", t.name);
        let ty = match t.elem {
            ElemTy::I32 => quote!(i32),
            ElemTy::F32 => quote!(f32),
            ElemTy::F16 => quote!(::flashgen::half::f16),
            ElemTy::Bf16 => quote!(::flashgen::half::bf16),
        };
        let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
        let doc = format!("Captured tensor `{}: {}[{}]`, row-major.", t.name, t.elem.name(), dims.join(", "));
        quote!(#[doc = #doc] pub #field: &'a ::flashgen::cudarc::driver::CudaSlice<#ty>)
    });
    let has_fields = !(spec.params.is_empty() && spec.tensors.is_empty());
    let (lifetime, args_ty) =
        if spec.tensors.is_empty() { (quote!(), quote!(#args_name)) } else { (quote!(<'a>), quote!(#args_name<'_>)) };
    let args_def = if has_fields {
        quote!(#vis struct #args_name #lifetime { #(#param_fields,)* #(#tensor_fields,)* })
    } else {
        quote!(#vis struct #args_name;)
    };
    (args_def, args_ty)
}
