//! `remora-rpcgen`: an RPCL (`.x`) parser and Rust code generator for Remora's ONC RPC
//! runtime ([`remora_xdr`-based encoding](https://www.rfc-editor.org/rfc/rfc4506) and the
//! `remora-oncrpc` client/server).
//!
//! # Using it
//!
//! From a `build.rs`:
//!
//! ```no_run
//! // build.rs: `fn main() { ... }`
//! remora_rpcgen::Generator::new()
//!     .define("REMORA", None)
//!     .compile_to_out_dir("proto/gpu.x")
//!     .unwrap_or_else(|e| panic!("{e}"));
//! ```
//!
//! ```ignore
//! // src/lib.rs
//! pub mod gpu {
//!     include!(concat!(env!("OUT_DIR"), "/gpu.rs"));
//! }
//! ```
//!
//! [`Generator::compile_to_out_dir`] writes `$OUT_DIR/<stem>.rs` and prints
//! `cargo:rerun-if-changed` for the `.x` file and every file it `#include`s. To get the code
//! as a string use [`Generator::generate_file`] or [`Generator::generate_str`].
//!
//! For a ready-to-build crate (what `remora rpcgen FILE.x -o DIR` does), use
//! [`generate_crate`] with [`CrateOptions`].
//!
//! # The language
//!
//! Everything in RFC 5531 section 12 and RFC 4506 section 6, plus rpcgen's extensions:
//!
//! * `const`, `enum` (values may be omitted: previous + 1), `struct`, `union` (switch on
//!   `int`, `unsigned int`, `bool`, an enum, or a typedef of one; several `case` labels per
//!   arm; `default`; `void` arms), `typedef`, `program`/`version`/procedure, with several
//!   programs and versions, several arguments per procedure (`rpcgen -N` style), `void`
//!   arguments and results.
//! * Fixed and variable arrays, `opaque[n]`, `opaque<n>`, `opaque<>`, `string<n>`,
//!   `string<>`, optional data `T *` (recursive lists included), `struct X`/`enum X`/`union X`
//!   as type specifiers, and anonymous inline `struct {…}`, `enum {…}`, `union switch …` in
//!   declarations (named `<outer>_<field>`; in `typedef struct {…} name;` the type is `name`).
//! * Constants: decimal, hex, octal, negative; `const` names and enum values as sizes, bounds
//!   and case labels; `TRUE`/`FALSE` are 1 and 0 unless defined.
//! * Base types `int`, `unsigned int`, `unsigned`, `hyper`, `unsigned hyper`, `float`,
//!   `double`, `bool`, and rpcgen's aliases `long`, `u_long`, `u_int`, `bool_t`, `int32_t`,
//!   `uint32_t`, `int64_t`, `uint64_t`, `quad_t`, `u_quad_t`, `char`, `u_char`, `short`,
//!   `u_short`, `unsigned char/short/long`. `quadruple` is rejected.
//! * `/* */` and `//` comments; `%` pass-through lines are ignored.
//! * A preprocessor: `#include "file"` (relative to the including file), object-like
//!   `#define NAME [value]`, `#undef`, `#ifdef`, `#ifndef`, `#if`, `#elif`, `#else`, `#endif`
//!   with integer expressions (`defined`, `!`, `&&`, `||`, comparisons, arithmetic,
//!   parentheses; undefined names are 0). `#pragma`, `#ident` and `# 12 "file"` markers are
//!   ignored. Nothing is predefined (not even `RPC_HDR`); add macros with
//!   [`Generator::define`].
//!
//! ## One-way procedures
//!
//! A comment containing `@oneway` directly before a procedure marks it one-way: the client
//! sends it with `call_oneway` and does not wait, the server sends no reply. It must return
//! `void`. C rpcgen's preprocessor drops the comment, so the file stays valid for it.
//!
//! ```text
//! /* @oneway */ void GPU_LOG(string<>) = 9;
//! ```
//!
//! ## Compatibility with C rpcgen inputs
//!
//! So that files written for C rpcgen (such as Debian's `/usr/include/rpcsvc/*.x`) generate
//! without edits:
//!
//! * `%#define NAME value` pass-through lines whose value is an integer expression over
//!   earlier ones become `const`s (C code sees them as macros, and files use them as bounds).
//! * `%#include <dir/NAME.h>` / `%#include "NAME.h"`, when `NAME.x` sits next to the including
//!   file, imports that file's constants and types (not its programs): C users get them from
//!   the header rpcgen generated from it.
//! * `const NAME = "text";` becomes `pub const NAME: &str`.
//! * The C RPC library's `netobj` (`opaque<1024>`), `des_block` (`opaque[8]`),
//!   `MAXNETNAMELEN` (255) and `MAX_NETOBJ_SZ` (1024) are built in when used and not
//!   defined.
//!
//! Generate such files with `-D RPC_HDR` (what `rpcgen -h` defines) when their types sit in
//! `#ifdef RPC_HDR` blocks.
//!
//! # Type mapping
//!
//! | RPCL | Rust | encoded with |
//! |---|---|---|
//! | `int`, `long`, `int32_t` | `i32` | `put_i32` / `get_i32` |
//! | `unsigned int`, `u_long`, `uint32_t` | `u32` | `put_u32` / `get_u32` |
//! | `hyper`, `unsigned hyper` | `i64`, `u64` | `put_i64`, `put_u64` |
//! | `float`, `double` | `f32`, `f64` | `put_f32`, `put_f64` |
//! | `bool`, `bool_t`* | `bool` | `put_bool` (`bool_t` is `int`, as in rpcgen) |
//! | `char`, `short` | `i8`, `i16` | 32-bit int, range-checked on decode |
//! | `u_char`, `u_short` | `u8`, `u16` | 32-bit unsigned, range-checked on decode |
//! | `opaque x[n]` | `[u8; n]` | `put_fixed_opaque` / `get_fixed_opaque::<n>` |
//! | `opaque x<n>` | `remora_xdr::Bytes` | `put_opaque_bytes(.., n)` / `get_opaque(n)` (zero-copy) |
//! | `string x<n>` | `String` | `put_string(.., n)` / `get_string(n)` |
//! | `T x[n]` | `[T; n]` (any `n`) | `put_fixed_array` / `get_fixed_array` |
//! | `T x<n>` | `Vec<T>` | `put_array(.., n, ..)` / `get_array(n, ..)` |
//! | `T *x` | `Option<Box<T>>` | `put_option` / `get_option` |
//! | `void` | `()` / unit variant | nothing |
//! | `const N = v;` | `pub const N: u32` (or `i32`, `u64`, `i64` by value) | |
//! | `enum e {…}` | `#[repr(i32)] pub enum E`, `TryFrom<i32>`, `From<E> for i32` | unknown values → `Error::UnknownDiscriminant` |
//! | `struct s {…}` | `pub struct S` (Debug, Clone, PartialEq, and Default when every field has one) | field by field |
//! | `union u switch (…) {…}` | `pub enum U`, one variant per case label, `Default { discriminant, value }` for `default:` | |
//! | `typedef … t;` | `pub type T = …;` plus `encode_t`/`decode_t` applying its bounds | |
//!
//! Every declaration is encoded with the primitive for its shape and **its own bound**; a
//! field whose type is a typedef goes through that typedef's `encode_`/`decode_` functions,
//! so typedef bounds always apply. Structs, enums and unions implement `XdrEncode` and
//! `XdrDecode`. Enum members with a value already used become associated constants
//! (`Zotypes::NIS_BOGUS_OBJ`).
//!
//! # Naming
//!
//! * Types, enum variants: `UpperCamelCase` of the C name, split at `_` and at lower-to-upper
//!   case changes (`nfs_fh` → `NfsFh`, `NFS_OK` → `NfsOk`). A type that would be named
//!   `Option`, `Box`, `Vec`, `String`, `Result`, `Some`, `None`, `Ok`, `Err` or `Self` is
//!   prefixed with `Xdr`.
//! * Fields, methods, functions: `snake_case` (`cuMemAlloc` → `cu_mem_alloc`); Rust keywords
//!   become raw identifiers (`r#type`), `self`/`super`/`crate` get a trailing `_`.
//! * Constants, including program, version and procedure numbers: `SCREAMING_SNAKE_CASE`.
//! * Union variants: from the case label — enum member or constant name in CamelCase,
//!   `Case0`/`CaseNeg1` for literals, `True`/`False` for bool.
//! * Per version `V`: `VClient`, `VServer` (trait), `VService<S>`.
//! * Two C names that convert to the same Rust name are an error naming both.
//! * Generated code may trip `dead_code`, `missing_docs`, `unreachable_pub`,
//!   `non_camel_case_types` and clippy's style lints ([`ALLOWED_LINTS`]). Include the code
//!   with `remora_xdr::include_generated!`, which puts `#[allow(..)]` with them on the module
//!   (an included file cannot carry inner attributes); crates written by `remora rpcgen`
//!   start with `#![allow(..)]`.
//!
//! # Generated client and server
//!
//! ```ignore
//! let client = NfsVersionClient::new(remora_oncrpc::Client::connect(&endpoint)?)
//!     .with_timeout(std::time::Duration::from_secs(5));
//! let attr = client.nfsproc_getattr(&fh)?;
//!
//! struct Mine;
//! impl NfsVersionServer for Mine { /* one method per procedure, owned arguments */ }
//! let service = NfsVersionService::new(Mine); // implements remora_oncrpc::Service
//! ```
//!
//! Client methods take arguments by reference and return `Result<R, RpcError>`; server
//! methods get `&CallContext` and owned arguments and return `ProcResult<R>`. The service
//! answers `GARBAGE_ARGS` when arguments do not decode or have trailing bytes, `SYSTEM_ERR`
//! when a result cannot be encoded, `PROC_UNAVAIL` for unknown procedures, and success with
//! an empty reply for procedure 0 when the file does not declare it.
//!
//! # Not supported
//!
//! `quadruple`; function-like macros; `#include <…>`; constant expressions in sizes (C
//! rpcgen passes them to the C compiler); `%` lines (meaningful to C output only).
//! Fixed arrays are always Rust arrays, so very large ones live inline in their struct.
#![forbid(unsafe_code)]

mod ast;
mod error;
mod generate;
mod krate;
mod lex;
mod names;
mod parse;
mod pp;
mod schema;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use error::{Diagnostic, Error, Result};
pub use generate::ALLOWED_LINTS;
pub use krate::{CrateOptions, CrateReport, default_runtime, generate_crate};
pub use schema::{Procedure, Schema, TypeInfo, UnionArm};

/// How every generated file starts; used to recognise our own output.
pub const HEADER_PREFIX: &str = "// Automatically generated by remora rpcgen from ";

/// Generated code and the files it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generated {
    /// The formatted Rust source, starting with the header line.
    pub code: String,
    /// The `.x` file and every file it included, in the order read.
    pub sources: Vec<PathBuf>,
}

/// Parses RPCL and generates Rust. Configure with the builder methods, then call one of the
/// `generate` methods.
#[derive(Debug, Clone, Default)]
pub struct Generator {
    defines: Vec<(String, Option<String>)>,
    virtual_files: HashMap<PathBuf, String>,
}

impl Generator {
    /// A generator with nothing predefined.
    pub fn new() -> Self {
        Self::default()
    }

    /// Predefines `name` for the preprocessor, like `-D name[=value]` (`None` means `1`).
    pub fn define(mut self, name: &str, value: Option<&str>) -> Self {
        self.defines
            .push((name.to_owned(), value.map(str::to_owned)));
        self
    }

    /// Predefines a macro given as `NAME` or `NAME=VALUE`, checking the name.
    pub fn define_arg(self, arg: &str) -> Result<Self> {
        let (name, value) = match arg.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (arg, None),
        };
        let valid = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(Error::Options(format!(
                "invalid -D argument '{arg}': expected NAME or NAME=VALUE with NAME a C identifier"
            )));
        }
        Ok(self.define(name, value))
    }

    /// Makes `path` read as `contents` instead of from the file system (for in-memory
    /// sources and their includes).
    pub fn virtual_file(mut self, path: impl Into<PathBuf>, contents: impl Into<String>) -> Self {
        self.virtual_files.insert(path.into(), contents.into());
        self
    }

    /// Generates Rust for the `.x` file at `path`.
    pub fn generate_file(&self, path: impl AsRef<Path>) -> Result<String> {
        self.generate(path).map(|g| g.code)
    }

    /// Generates Rust for `source`, named `name` in messages and in the header. Includes are
    /// resolved relative to `name`.
    pub fn generate_str(&self, name: &str, source: &str) -> Result<String> {
        self.clone()
            .virtual_file(name, source)
            .generate(name)
            .map(|g| g.code)
    }

    /// Generates Rust for the `.x` file at `path`, also returning every file read.
    pub fn generate(&self, path: impl AsRef<Path>) -> Result<Generated> {
        let path = path.as_ref();
        let pp = pp::Preprocessor::new(&self.defines, self.virtual_files.clone());
        let (files, tokens) = pp.run(path, path.display().to_string())?;
        let defs = parse::parse(&tokens, &files)?;
        let code = generate::Gen::new(&files, &defs)?.generate()?;
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let code = generate::format_source(&name, &code)?;
        let mut sources: Vec<PathBuf> = Vec::new();
        for f in files.files {
            if !sources.contains(&f.path) {
                sources.push(f.path);
            }
        }
        Ok(Generated { code, sources })
    }

    /// The procedures and types of the `.x` file at `path`, with the Rust names
    /// [`Generator::generate`] gives them (for generators that build on that code).
    pub fn schema(&self, path: impl AsRef<Path>) -> Result<Schema> {
        let path = path.as_ref();
        let pp = pp::Preprocessor::new(&self.defines, self.virtual_files.clone());
        let (files, tokens) = pp.run(path, path.display().to_string())?;
        let defs = parse::parse(&tokens, &files)?;
        generate::Gen::new(&files, &defs)?.schema()
    }

    /// For `build.rs`: generates `$OUT_DIR/<stem>.rs` from `path`, prints
    /// `cargo:rerun-if-changed` for it and every included file, and returns the written path.
    pub fn compile_to_out_dir(&self, path: impl AsRef<Path>) -> Result<PathBuf> {
        let out_dir = std::env::var_os("OUT_DIR").ok_or_else(|| {
            Error::Options("OUT_DIR is not set: compile_to_out_dir is meant for build.rs".into())
        })?;
        self.compile_to(path, Path::new(&out_dir))
    }

    /// Like [`Generator::compile_to_out_dir`], writing into `dir`.
    pub fn compile_to(&self, path: impl AsRef<Path>, dir: &Path) -> Result<PathBuf> {
        let path = path.as_ref();
        let generated = self.generate(path);
        // Ask to be re-run on changes even when generation failed.
        let sources = match &generated {
            Ok(g) => g.sources.clone(),
            Err(_) => vec![path.to_path_buf()],
        };
        for s in &sources {
            println!("cargo:rerun-if-changed={}", s.display());
        }
        let generated = generated?;
        let stem = path
            .file_stem()
            .ok_or_else(|| Error::Options(format!("'{}' has no file name", path.display())))?;
        let out = dir.join(format!("{}.rs", stem.to_string_lossy()));
        std::fs::write(&out, generated.code).map_err(|e| Error::io("writing", &out, e))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
