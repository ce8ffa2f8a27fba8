//! Errors: every problem in an input file is reported as `file:line:col: message`.

use std::fmt;
use std::path::PathBuf;

/// A position in a source file (1-based line and column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct Pos {
    /// Index into the file table.
    pub(crate) file: u32,
    pub(crate) line: u32,
    pub(crate) col: u32,
}

/// One source file read while generating, and where it was included from.
#[derive(Debug, Clone)]
pub(crate) struct SourceFile {
    /// The name used in messages: the path as given, or joined onto the including file's
    /// directory.
    pub(crate) display: String,
    pub(crate) path: PathBuf,
    pub(crate) included_from: Option<Pos>,
}

/// The table of files read so far; positions refer into it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Files {
    pub(crate) files: Vec<SourceFile>,
}

impl Files {
    pub(crate) fn diag(&self, pos: Pos, message: impl Into<String>) -> Error {
        let (file, include_chain) = match self.files.get(pos.file as usize) {
            Some(f) => {
                let mut chain = Vec::new();
                let mut from = f.included_from;
                while let Some(p) = from {
                    let Some(inc) = self.files.get(p.file as usize) else {
                        break;
                    };
                    chain.push(format!("{}:{}", inc.display, p.line));
                    from = inc.included_from;
                }
                (f.display.clone(), chain)
            }
            None => ("<input>".to_owned(), Vec::new()),
        };
        Error::Source(Diagnostic {
            file,
            line: pos.line,
            col: pos.col,
            message: message.into(),
            include_chain,
        })
    }

    pub(crate) fn describe(&self, pos: Pos) -> String {
        let name = self
            .files
            .get(pos.file as usize)
            .map_or("<input>", |f| f.display.as_str());
        format!("{name}:{}:{}", pos.line, pos.col)
    }
}

/// A problem found in an RPCL source file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// The file, as named on the command line or in the `#include` that read it.
    pub file: String,
    /// 1-based line.
    pub line: u32,
    /// 1-based column.
    pub col: u32,
    /// What is wrong, and what was expected.
    pub message: String,
    /// Where the file was included from, innermost first, each as `file:line`.
    pub include_chain: Vec<String>,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.col, self.message
        )?;
        for inc in &self.include_chain {
            write!(f, "\n    included from {inc}")?;
        }
        Ok(())
    }
}

/// Everything that can go wrong in [`crate::Generator`] and [`crate::generate_crate`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A syntax or semantic error in an input file, with its location.
    Source(Diagnostic),
    /// A file could not be read or written.
    Io {
        /// What was being done ("reading", "writing", ...).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Invalid options (output directory, runtime path, crate name, defines).
    Options(String),
    /// The generated code did not parse as Rust: a bug in the generator.
    Internal(String),
}

impl Error {
    /// The diagnostic, when the error is about an input file.
    pub fn diagnostic(&self) -> Option<&Diagnostic> {
        match self {
            Error::Source(d) => Some(d),
            _ => None,
        }
    }

    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Source(d) => d.fmt(f),
            Error::Io {
                action,
                path,
                source,
            } => write!(f, "error {action} {}: {source}", path.display()),
            Error::Options(m) => f.write_str(m),
            Error::Internal(m) => write!(f, "internal error in remora rpcgen: {m}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
