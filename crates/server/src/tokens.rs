//! The server's tokens (`remora serve --auth-token-file FILE`): which tenant each token
//! names, and finding a client's token among them in constant time.
//!
//! The file is private (mode 0600 or stricter: refused otherwise, like ssh refuses an open
//! key) and lists one tenant a line:
//!
//! ```text
//! # tenant   token
//! alice      4f9c0d6e2a71b8e35c0d9a6b7e1f2a3c
//! ci.runner  8d1e7c52b9a04f6e3d2c1b0a9f8e7d6c
//! ```
//!
//! Blank lines and lines starting with `#` are skipped. Tenant names are 1 to 64 characters
//! of `[A-Za-z0-9_.-]`; tokens at least 16 printable ASCII characters without spaces
//! ([`remora_proto::token`]). A tenant or a token listed twice is refused. Error messages name
//! the line, never a token.

use std::fmt;
use std::path::Path;

use remora_proto::token::{SecretFileError, read_private_file, token_problem, tokens_equal};

/// Longest tenant name.
pub const MAX_TENANT: usize = 64;

/// The tokens a server accepts, each naming a tenant. `Debug` shows the tenants only.
#[derive(Clone)]
pub struct Tokens {
    entries: Vec<(String, Vec<u8>)>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens")
            .field(
                "tenants",
                &self.entries.iter().map(|(t, _)| t).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

/// Why a tenant name is not valid (the rule client certificates' names follow too).
fn tenant_problem(name: &str) -> Option<String> {
    remora_oncrpc::tls::tenant_name_problem(name)
}

impl Tokens {
    /// Reads and checks the token file `path` (see the module documentation).
    pub fn load(path: &Path) -> Result<Self, SecretFileError> {
        Self::parse(path, &read_private_file(path)?)
    }

    /// Parses the text of a token file; `path` is only for messages.
    pub fn parse(path: &Path, text: &str) -> Result<Self, SecretFileError> {
        let malformed = |line: usize, problem: String| SecretFileError::Malformed {
            path: path.to_owned(),
            line,
            problem,
        };
        let mut entries: Vec<(String, Vec<u8>)> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_ascii_whitespace();
            let (Some(tenant), Some(token), None) = (fields.next(), fields.next(), fields.next())
            else {
                return Err(malformed(
                    n,
                    "expected two fields, `TENANT TOKEN` (tokens have no spaces)".to_owned(),
                ));
            };
            if let Some(problem) = tenant_problem(tenant) {
                return Err(malformed(n, problem));
            }
            if let Some(problem) = token_problem(token.as_bytes()) {
                return Err(malformed(n, problem));
            }
            if entries.iter().any(|(t, _)| t == tenant) {
                return Err(malformed(
                    n,
                    format!("the tenant {tenant} is listed twice; give each tenant one line"),
                ));
            }
            if entries.iter().any(|(_, k)| k == token.as_bytes()) {
                return Err(malformed(
                    n,
                    "this token is also another tenant's; give every tenant a token of its own"
                        .to_owned(),
                ));
            }
            entries.push((tenant.to_owned(), token.as_bytes().to_vec()));
        }
        if entries.is_empty() {
            return Err(SecretFileError::Empty(path.to_owned()));
        }
        Ok(Self { entries })
    }

    /// The tenant whose token `token` is, if any. Every token is compared, each in constant
    /// time, so the time taken tells nothing about how close `token` came to one.
    pub fn tenant_of(&self, token: &[u8]) -> Option<&str> {
        let mut found = None;
        for (tenant, known) in &self.entries {
            if tokens_equal(known, token) {
                found = Some(tenant.as_str());
            }
        }
        found
    }

    /// How many tenants there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none (never true of a loaded file).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0123456789abcdef";
    const B: &str = "fedcba9876543210XYZ";

    fn parse(text: &str) -> Result<Tokens, SecretFileError> {
        Tokens::parse(Path::new("tokens"), text)
    }

    fn line_of(e: &SecretFileError) -> usize {
        match e {
            SecretFileError::Malformed { line, .. } => *line,
            other => panic!("not a malformed-line error: {other}"),
        }
    }

    #[test]
    fn tenants_are_found_by_their_tokens() {
        let t = parse(&format!("# comment\n\nalice {A}\n  ci.runner-2\t{B}  \n")).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.tenant_of(A.as_bytes()), Some("alice"));
        assert_eq!(t.tenant_of(B.as_bytes()), Some("ci.runner-2"));
        assert_eq!(t.tenant_of(b"0123456789abcdeX"), None);
        assert_eq!(t.tenant_of(b""), None);
        assert!(!format!("{t:?}").contains(A), "Debug must not show tokens");
    }

    #[test]
    fn malformed_lines_are_named_and_tokens_never_shown() {
        for (text, line) in [
            (format!("alice {A}\nbob\n"), 2),
            (format!("alice {A} extra\n"), 1),
            ("\n\nalice short\n".to_owned(), 3),
            (format!("al ice {A}\n"), 1),
            (format!("al/ice {A}\n"), 1),
            (format!("{} {A}\n", "a".repeat(65)), 1),
            (format!("alice {A}\nalice {B}\n"), 2),
            (format!("alice {A}\nbob {A}\n"), 2),
        ] {
            let e = parse(&text).unwrap_err();
            assert_eq!(line_of(&e), line, "{text:?}: {e}");
            let msg = e.to_string();
            assert!(!msg.contains(A) && !msg.contains(B), "{msg}");
        }
        assert!(matches!(
            parse("# only comments\n\n").unwrap_err(),
            SecretFileError::Empty(_)
        ));
    }
}
