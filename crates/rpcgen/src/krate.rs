//! Writing a ready-to-build crate (`remora rpcgen FILE.x -o DIR`).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::{Generator, HEADER_PREFIX};

/// What [`generate_crate`] should do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrateOptions {
    /// The `.x` file.
    pub input: PathBuf,
    /// The crate directory to create (or to overwrite, if remora rpcgen wrote it).
    pub out_dir: PathBuf,
    /// The Remora source tree holding `crates/xdr` and `crates/oncrpc`; `None` means the tree
    /// this generator was built from.
    pub runtime: Option<PathBuf>,
    /// Preprocessor definitions, like `-D NAME[=VALUE]`.
    pub defines: Vec<(String, Option<String>)>,
    /// The package name; `None` derives it from the input's file stem (`nfs_prot.x` →
    /// `nfs-prot`).
    pub crate_name: Option<String>,
    /// Whether `Cargo.toml` gets an empty `[workspace]` table so the crate builds on its own
    /// (default). Turn it off to make the crate a member of an enclosing workspace.
    pub standalone: bool,
}

impl CrateOptions {
    /// Options for generating a standalone crate from `input` into `out_dir`.
    pub fn new(input: impl Into<PathBuf>, out_dir: impl Into<PathBuf>) -> Self {
        Self {
            input: input.into(),
            out_dir: out_dir.into(),
            runtime: None,
            defines: Vec::new(),
            crate_name: None,
            standalone: true,
        }
    }

    /// Sets the Remora source tree the crate depends on.
    pub fn runtime(mut self, path: impl Into<PathBuf>) -> Self {
        self.runtime = Some(path.into());
        self
    }

    /// Adds a preprocessor definition (`None` means `1`).
    pub fn define(mut self, name: &str, value: Option<&str>) -> Self {
        self.defines
            .push((name.to_owned(), value.map(str::to_owned)));
        self
    }

    /// Sets the package name.
    pub fn crate_name(mut self, name: impl Into<String>) -> Self {
        self.crate_name = Some(name.into());
        self
    }

    /// Whether to write an empty `[workspace]` table (see [`CrateOptions::standalone`]).
    pub fn standalone(mut self, standalone: bool) -> Self {
        self.standalone = standalone;
        self
    }
}

/// What [`generate_crate`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrateReport {
    /// The package name.
    pub crate_name: String,
    /// The crate directory.
    pub dir: PathBuf,
    /// The files written (`Cargo.toml`, `src/lib.rs`).
    pub written: Vec<PathBuf>,
    /// The `.x` file and every file it included.
    pub sources: Vec<PathBuf>,
    /// The runtime tree the crate depends on (absolute).
    pub runtime: PathBuf,
}

/// The Remora source tree this crate was built from.
pub fn default_runtime() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = here.join("../..");
    root.canonicalize().unwrap_or(root)
}

/// A package name from a file stem: lower case, `-` for anything but letters and digits.
fn package_name(stem: &str) -> String {
    let mut s: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    s = s.trim_matches('-').to_owned();
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert_str(0, "xdr-");
    }
    s
}

fn toml_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Checks that `dir` is absent, empty, or an earlier output of remora rpcgen.
fn check_out_dir(dir: &Path) -> Result<()> {
    let mut entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("reading directory", dir, e)),
    };
    if entries.next().is_none() {
        return Ok(());
    }
    let lib = dir.join("src/lib.rs");
    let ours = std::fs::read_to_string(&lib).is_ok_and(|s| s.starts_with(HEADER_PREFIX));
    if ours {
        Ok(())
    } else {
        Err(Error::Options(format!(
            "refusing to write into '{}': the directory is not empty and was not produced by remora rpcgen (no generated src/lib.rs); choose an empty or new directory",
            dir.display()
        )))
    }
}

/// Generates a ready-to-build crate: `Cargo.toml` depending on `remora-xdr` and
/// `remora-oncrpc` by path, and `src/lib.rs` with the generated code.
///
/// Refuses a non-empty directory that remora rpcgen did not write; overwrites its own
/// earlier output.
pub fn generate_crate(opts: &CrateOptions) -> Result<CrateReport> {
    let runtime = opts.runtime.clone().unwrap_or_else(default_runtime);
    for sub in ["crates/xdr", "crates/oncrpc"] {
        if !runtime.join(sub).join("Cargo.toml").is_file() {
            return Err(Error::Options(format!(
                "runtime path '{}' does not contain {sub}/Cargo.toml: expected the root of the Remora source tree",
                runtime.display()
            )));
        }
    }
    let runtime = runtime
        .canonicalize()
        .map_err(|e| Error::io("resolving", &runtime, e))?;
    let stem = opts
        .input
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .ok_or_else(|| Error::Options(format!("'{}' has no file name", opts.input.display())))?;
    let crate_name = match &opts.crate_name {
        Some(n) => {
            if n.is_empty()
                || !n.starts_with(|c: char| c.is_ascii_alphabetic())
                || !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(Error::Options(format!(
                    "invalid crate name '{n}': expected letters, digits, '-' and '_', starting with a letter"
                )));
            }
            n.clone()
        }
        None => package_name(&stem),
    };
    check_out_dir(&opts.out_dir)?;

    let mut generator = Generator::new();
    generator.defines.clone_from(&opts.defines);
    let generated = generator.generate(&opts.input)?;
    let file_name = opts
        .input
        .file_name()
        .map_or_else(|| stem.clone(), |n| n.to_string_lossy().into_owned());

    let mut cargo = format!(
        "# Automatically generated by remora rpcgen from {file_name}. Do not edit.\n\
         [package]\nname = {}\nversion = \"0.1.0\"\nedition = \"2024\"\npublish = false\n\n\
         [dependencies]\nremora-xdr = {{ path = {} }}\nremora-oncrpc = {{ path = {} }}\n",
        toml_str(&crate_name),
        toml_str(&runtime.join("crates/xdr").display().to_string()),
        toml_str(&runtime.join("crates/oncrpc").display().to_string()),
    );
    if opts.standalone {
        cargo.push_str("\n# Builds on its own, outside any enclosing workspace.\n[workspace]\n");
    }

    let body = generated
        .code
        .split_once('\n')
        .map_or(generated.code.as_str(), |(_, rest)| rest);
    let lib = format!(
        "{}{}{}",
        crate::generate::header(&file_name).trim_end(),
        "\n",
        crate_doc(&file_name, &crate_name, body)
    ) + body;

    let src = opts.out_dir.join("src");
    std::fs::create_dir_all(&src).map_err(|e| Error::io("creating", &src, e))?;
    let cargo_path = opts.out_dir.join("Cargo.toml");
    let lib_path = src.join("lib.rs");
    std::fs::write(&cargo_path, cargo).map_err(|e| Error::io("writing", &cargo_path, e))?;
    std::fs::write(&lib_path, lib).map_err(|e| Error::io("writing", &lib_path, e))?;
    Ok(CrateReport {
        crate_name,
        dir: opts.out_dir.clone(),
        written: vec![cargo_path, lib_path],
        sources: generated.sources,
        runtime,
    })
}

/// The crate-level documentation of a generated crate.
fn crate_doc(file_name: &str, crate_name: &str, code: &str) -> String {
    let lib = crate_name.replace('-', "_");
    let versions: Vec<&str> = code
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub struct "))
        .filter_map(|l| l.split_once("Client {").map(|(n, _)| n))
        .collect();
    let mut doc = format!(
        "//! Rust bindings for the ONC RPC protocol in `{file_name}`, generated by remora rpcgen.\n\
         //!\n\
         //! Every XDR type implements `remora_xdr::XdrEncode` and `remora_xdr::XdrDecode`.\n"
    );
    if let Some(v) = versions.first() {
        doc.push_str(&format!(
            "//!\n\
             //! Program versions: {}.\n\
             //!\n\
             //! # Client\n\
             //!\n\
             //! ```ignore\n\
             //! let rpc = remora_oncrpc::Client::connect(&remora_oncrpc::Endpoint::Tcp(\"host:port\".into()))?;\n\
             //! let client = {lib}::{v}Client::new(rpc)\n\
             //!     .with_timeout(std::time::Duration::from_secs(5));\n\
             //! // One method per procedure: arguments by reference, `Result<R, RpcError>` back.\n\
             //! ```\n\
             //!\n\
             //! # Server\n\
             //!\n\
             //! Implement `{v}Server` (one method per procedure, taking `&CallContext` and owned\n\
             //! arguments, returning `ProcResult<R>`), wrap it in `{v}Service::new(..)`, and register\n\
             //! that `remora_oncrpc::Service` with a `remora_oncrpc::Server`.\n",
            versions
                .iter()
                .map(|v| format!("`{v}Client` / `{v}Server` / `{v}Service`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    doc.push_str(&format!(
        "#![allow({})]\n\n",
        crate::generate::ALLOWED_LINTS
    ));
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_names() {
        assert_eq!(package_name("nfs_prot"), "nfs-prot");
        assert_eq!(package_name("Gpu"), "gpu");
        assert_eq!(package_name("9p"), "xdr-9p");
    }

    #[test]
    fn toml_escaping() {
        assert_eq!(toml_str("a\"b\\c"), "\"a\\\"b\\\\c\"");
    }
}
