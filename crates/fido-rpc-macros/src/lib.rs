//! `#[fido_rpc::service]`: turns a Rust trait into a fido-rpc service — the
//! server's dispatch table (`<Trait>Server<S>`) and the client stubs
//! (`<Trait>Client`, `<Trait>AsyncClient`). No IDL: the trait is the contract.
//!
//! This crate only generates code: it must never emit `unsafe`, and the code
//! it emits must decode every argument through fido-rpc's checked readers.
//!
//! Each method is `fn name(&self, cx: &mut fido_rpc::Ctx<'_>, arg: T, ...) -> Ret`
//! where every `T` is `Pod` (scalars, `#[repr(C)]` structs, `ShmSlice`,
//! `ShmStr`). `Ret` is one of:
//! - `Result<R, Failure<E>>`: a result, an application error `E`, or a fault;
//! - `Result<R, Fault>`: a result or a fault;
//! - `Result<R, E>`: a result or an application error;
//! - `R` (or nothing): always succeeds.
//!
//! A method marked `#[oneway]` returns nothing and is never answered.

#![forbid(unsafe_code)]

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::{format_ident, quote};
use syn::{parse_macro_input, FnArg, GenericArgument, ItemTrait, PathArguments, ReturnType, TraitItem, Type};

enum ErrKind {
    /// `Result<R, Failure<E>>`
    Failure(Type),
    /// `Result<R, Fault>`
    Fault,
    /// `Result<R, E>`
    App(Type),
    /// `R`
    None,
}

fn last_ident(ty: &Type) -> Option<(String, Vec<Type>)> {
    if let Type::Path(p) = ty {
        let seg = p.path.segments.last()?;
        let mut args = Vec::new();
        if let PathArguments::AngleBracketed(a) = &seg.arguments {
            for g in &a.args {
                if let GenericArgument::Type(t) = g {
                    args.push(t.clone());
                }
            }
        }
        return Some((seg.ident.to_string(), args));
    }
    None
}

fn classify(ret: &ReturnType) -> (Type, ErrKind) {
    let unit: Type = syn::parse_quote!(());
    let ty = match ret {
        ReturnType::Default => return (unit, ErrKind::None),
        ReturnType::Type(_, t) => (**t).clone(),
    };
    if let Some((name, args)) = last_ident(&ty) {
        if name == "Result" && args.len() == 2 {
            let r = args[0].clone();
            let e = args[1].clone();
            if let Some((en, eargs)) = last_ident(&e) {
                if en == "Failure" && eargs.len() == 1 {
                    return (r, ErrKind::Failure(eargs[0].clone()));
                }
                if en == "Fault" && eargs.is_empty() {
                    return (r, ErrKind::Fault);
                }
            }
            return (r, ErrKind::App(e));
        }
    }
    (ty, ErrKind::None)
}

#[proc_macro_attribute]
pub fn service(_attr: TokenStream, item: TokenStream) -> TokenStream {
    let mut tr = parse_macro_input!(item as ItemTrait);
    match expand(&mut tr) {
        Ok(ts) => ts.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn expand(tr: &mut ItemTrait) -> syn::Result<TokenStream2> {
    let name = tr.ident.clone();
    let vis = tr.vis.clone();
    let server = format_ident!("{}Server", name);
    let client = format_ident!("{}Client", name);
    let aclient = format_ident!("{}AsyncClient", name);
    let methods_const = format_ident!("{}_METHODS", name.to_string().to_uppercase());

    let mut arms = Vec::new();
    let mut stubs = Vec::new();
    let mut astubs = Vec::new();
    let mut names = Vec::new();
    let mut index: u32 = 0;

    for item in tr.items.iter_mut() {
        let TraitItem::Fn(f) = item else { continue };
        let oneway = f.attrs.iter().any(|a| a.path().is_ident("oneway"));
        f.attrs.retain(|a| !a.path().is_ident("oneway"));
        let mname = f.sig.ident.clone();
        let mut inputs = f.sig.inputs.iter();
        match inputs.next() {
            Some(FnArg::Receiver(r)) if r.reference.is_some() && r.mutability.is_none() => {}
            _ => return Err(syn::Error::new_spanned(&f.sig, "a service method takes `&self` first")),
        }
        match inputs.next() {
            Some(FnArg::Typed(_)) => {}
            _ => return Err(syn::Error::new_spanned(&f.sig, "a service method takes `cx: &mut fido_rpc::Ctx<'_>` second")),
        }
        let mut arg_names = Vec::new();
        let mut arg_types = Vec::new();
        for (i, a) in inputs.enumerate() {
            let FnArg::Typed(pt) = a else { unreachable!() };
            // The declared name when it is a plain identifier (readable
            // stubs), unless it would clash with the stubs' own parameters.
            let name = match &*pt.pat {
                syn::Pat::Ident(pi) if !["frame", "opts", "self", "cx"].contains(&pi.ident.to_string().as_str()) && !pi.ident.to_string().starts_with("__") => pi.ident.clone(),
                _ => format_ident!("__a{}", i),
            };
            arg_names.push(name);
            arg_types.push((*pt.ty).clone());
        }
        let (rty, kind) = classify(&f.sig.output);
        if oneway && !matches!(f.sig.output, ReturnType::Default) {
            return Err(syn::Error::new_spanned(&f.sig.output, "a #[oneway] method returns nothing"));
        }
        let sig_text = {
            let args: Vec<String> = arg_types.iter().map(|t| quote!(#t).to_string()).collect();
            let out = &f.sig.output;
            format!("{}({}){}", mname, args.join(","), quote!(#out)).replace(' ', "")
        };
        let idx = index;
        index += 1;
        names.push(mname.to_string());
        let app_err: TokenStream2 = match &kind {
            ErrKind::Failure(e) | ErrKind::App(e) => quote!(#e),
            _ => quote!(::fido_rpc::NoAppError),
        };
        let call = quote!(<S as #name>::#mname(&self.0, cx, #(#arg_names),*));
        let body = if oneway {
            quote! { #call; ::core::result::Result::Ok(()) }
        } else {
            match &kind {
                ErrKind::Failure(_) => quote! {
                    match #call {
                        ::core::result::Result::Ok(__r) => { cx.reply_ok(&__r); ::core::result::Result::Ok(()) }
                        ::core::result::Result::Err(::fido_rpc::Failure::App(__e)) => { cx.reply_err(&__e); ::core::result::Result::Ok(()) }
                        ::core::result::Result::Err(::fido_rpc::Failure::Fault(__f)) => ::core::result::Result::Err(__f),
                    }
                },
                ErrKind::Fault => quote! {
                    let __r = #call?;
                    cx.reply_ok(&__r);
                    ::core::result::Result::Ok(())
                },
                ErrKind::App(_) => quote! {
                    match #call {
                        ::core::result::Result::Ok(__r) => { cx.reply_ok(&__r); ::core::result::Result::Ok(()) }
                        ::core::result::Result::Err(__e) => { cx.reply_err(&__e); ::core::result::Result::Ok(()) }
                    }
                },
                ErrKind::None => quote! {
                    let __r = #call;
                    cx.reply_ok(&__r);
                    ::core::result::Result::Ok(())
                },
            }
        };
        arms.push(quote! {
            #idx => {
                const __SIG: u32 = ::fido_rpc::__private::sig_hash(#sig_text);
                if sig != ::fido_rpc::wire::SIG_ANY && sig != __SIG {
                    return ::core::result::Result::Err(::fido_rpc::Fault::BadSignature);
                }
                let mut __rd = cx.root();
                #( let #arg_names: #arg_types = __rd.get()?; )*
                __rd.finish()?;
                #body
            }
        });

        let with = format_ident!("{}_with", mname);
        let puts = quote! {
            let mut __w = ::fido_rpc::__private::RootWriter::new();
            #( __w.put(&#arg_names); )*
        };
        let doc = format!("Calls `{}` (method {}).", mname, idx);
        if oneway {
            stubs.push(quote! {
                #[doc = #doc]
                pub fn #mname(&self, frame: ::fido_rpc::Frame, #(#arg_names: #arg_types),*) -> ::core::result::Result<(), ::fido_rpc::RpcError> {
                    #puts
                    self.0.call_oneway(#idx, ::fido_rpc::__private::sig_hash(#sig_text), frame, __w.bytes())
                }
            });
            astubs.push(quote! {
                #[doc = #doc]
                pub async fn #mname(&self, frame: ::fido_rpc::Frame, #(#arg_names: #arg_types),*) -> ::core::result::Result<(), ::fido_rpc::RpcError> {
                    #puts
                    self.0.call_oneway(#idx, ::fido_rpc::__private::sig_hash(#sig_text), frame, __w.bytes()).await
                }
            });
        } else {
            let ret = quote!(::core::result::Result<::fido_rpc::Reply<#rty>, ::fido_rpc::CallError<#app_err>>);
            stubs.push(quote! {
                #[doc = #doc]
                pub fn #mname(&self, frame: ::fido_rpc::Frame, #(#arg_names: #arg_types),*) -> #ret {
                    self.#with(frame, &::fido_rpc::CallOpts::default(), #(#arg_names),*)
                }
                #[doc = #doc]
                pub fn #with(&self, frame: ::fido_rpc::Frame, opts: &::fido_rpc::CallOpts, #(#arg_names: #arg_types),*) -> #ret {
                    #puts
                    self.0.call::<#rty, #app_err>(#idx, ::fido_rpc::__private::sig_hash(#sig_text), frame, __w.bytes(), opts)
                }
            });
            astubs.push(quote! {
                #[doc = #doc]
                pub async fn #mname(&self, frame: ::fido_rpc::Frame, #(#arg_names: #arg_types),*) -> #ret {
                    self.#with(frame, &::fido_rpc::CallOpts::default(), #(#arg_names),*).await
                }
                #[doc = #doc]
                pub async fn #with(&self, frame: ::fido_rpc::Frame, opts: &::fido_rpc::CallOpts, #(#arg_names: #arg_types),*) -> #ret {
                    #puts
                    self.0.call::<#rty, #app_err>(#idx, ::fido_rpc::__private::sig_hash(#sig_text), frame, __w.bytes(), opts).await
                }
            });
        }
    }

    let sdoc = format!("The dispatch table of `{name}`: serve it with `fido_rpc::Server::spawn(&domain, service, {server}(impl), opts)`.");
    let cdoc = format!("Blocking client stubs of `{name}`.");
    let adoc = format!("Async (tokio) client stubs of `{name}`.");
    Ok(quote! {
        #tr

        /// Method names of the service, in index order (the C ABI calls by index).
        #vis const #methods_const: &[&str] = &[#(#names),*];

        #[doc = #sdoc]
        #vis struct #server<S>(pub S);

        impl<S: #name + ::core::marker::Send + ::core::marker::Sync + 'static> ::fido_rpc::Dispatch for #server<S> {
            fn methods(&self) -> &'static [&'static str] {
                #methods_const
            }
            #[allow(unused_mut, clippy::let_unit_value, clippy::unit_arg)]
            fn dispatch(&self, method: u32, sig: u32, cx: &mut ::fido_rpc::Ctx<'_>) -> ::core::result::Result<(), ::fido_rpc::Fault> {
                match method {
                    #(#arms)*
                    _ => ::core::result::Result::Err(::fido_rpc::Fault::UnknownMethod),
                }
            }
        }

        #[doc = #cdoc]
        #vis struct #client(pub ::fido_rpc::Client);

        #[allow(clippy::too_many_arguments, clippy::unit_arg)]
        impl #client {
            pub fn connect(domain: &::fido_rpc::fido::Domain, service: &str) -> ::core::result::Result<Self, ::fido_rpc::RpcError> {
                ::fido_rpc::Client::connect(domain, service).map(#client)
            }
            /// A frame (in our arena) for the next call's arguments.
            pub fn frame(&self) -> ::core::result::Result<::fido_rpc::Frame, ::fido_rpc::RpcError> {
                self.0.frame()
            }
            #(#stubs)*
        }

        #[doc = #adoc]
        #vis struct #aclient(pub ::fido_rpc::AsyncClient);

        #[allow(clippy::too_many_arguments, clippy::unit_arg)]
        impl #aclient {
            pub fn connect(domain: &::fido_rpc::fido::Domain, service: &str) -> ::core::result::Result<Self, ::fido_rpc::RpcError> {
                ::fido_rpc::AsyncClient::connect(domain, service).map(#aclient)
            }
            pub fn frame(&self) -> ::core::result::Result<::fido_rpc::Frame, ::fido_rpc::RpcError> {
                self.0.frame()
            }
            #(#astubs)*
        }
    })
}
