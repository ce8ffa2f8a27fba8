//! The token of `REMORA_HELLO_AUTH`: what a valid one looks like, comparing two without
//! leaking where they differ, and reading one from a file only its owner can read.
//!
//! Both ends use this: `remora serve --auth-token-file` (whose file lists `TENANT TOKEN`
//! lines, parsed by the server) and clients (`REMORA_AUTH_TOKEN_FILE`, `remora run
//! --auth-token-file`, whose file holds just the token).

use std::path::{Path, PathBuf};

use remora_oncrpc::{Endpoint, OpeningCall};
use remora_xdr::{Bytes, Encoder, XdrEncode};

use crate::remora::{
    HelloArgs, HelloAuthArgs, REMORA_HELLO_AUTH, REMORA_MAX_TOKEN, REMORA_MIN_TOKEN, REMORA_PROG,
    REMORA_V1,
};

/// The `REMORA_HELLO_AUTH` call with `hello` and `token`, to be made first on a connection
/// (`ClientConfig::opening_call`): before it moves into shared memory, since a server with
/// tokens serves nothing else before it.
pub fn hello_auth_call(hello: &HelloArgs, token: &[u8]) -> remora_xdr::Result<OpeningCall> {
    let mut enc = Encoder::new();
    HelloAuthArgs {
        hello: hello.clone(),
        token: Bytes::copy_from_slice(token),
    }
    .encode(&mut enc)?;
    Ok(OpeningCall {
        program: REMORA_PROG,
        version: REMORA_V1,
        procedure: REMORA_HELLO_AUTH,
        args: enc.to_bytes(),
    })
}

/// What to tell the user when connecting to `endpoint` failed because of authentication
/// (`with_token`: the client presented one); `None` for other failures.
pub fn auth_problem(
    e: &remora_oncrpc::RpcError,
    endpoint: &Endpoint,
    with_token: bool,
) -> Option<String> {
    use remora_oncrpc::{AuthStat, RpcError};
    match e {
        RpcError::AuthError {
            stat: AuthStat::TooWeak,
        } => Some(format!(
            "remora: authentication required: the server at {endpoint} serves only clients \
             that present a token; set REMORA_AUTH_TOKEN (or REMORA_AUTH_TOKEN_FILE, a file of \
             mode 0600 holding it; `remora run --auth-token-file FILE`)"
        )),
        RpcError::AuthError { stat } if with_token => Some(format!(
            "remora: authentication failed: the server at {endpoint} does not know this token \
             ({stat}); check REMORA_AUTH_TOKEN or the token file against the server's \
             --auth-token-file"
        )),
        RpcError::ProcUnavail { procedure, .. }
            if with_token && *procedure == REMORA_HELLO_AUTH =>
        {
            Some(format!(
                "remora: the server at {endpoint} does not support authentication tokens (it \
                 predates REMORA_HELLO_AUTH): upgrade it, or unset REMORA_AUTH_TOKEN and \
                 REMORA_AUTH_TOKEN_FILE to connect without a token"
            ))
        }
        _ => None,
    }
}

/// Why a token is not valid (the token itself is never part of the message).
pub fn token_problem(token: &[u8]) -> Option<String> {
    if token.len() < REMORA_MIN_TOKEN as usize {
        return Some(format!(
            "the token is {} characters long; tokens have at least {REMORA_MIN_TOKEN} \
             (make one with e.g. `openssl rand -hex 32`)",
            token.len()
        ));
    }
    if token.len() > REMORA_MAX_TOKEN as usize {
        return Some(format!(
            "the token is {} characters long; tokens have at most {REMORA_MAX_TOKEN}",
            token.len()
        ));
    }
    if !token.iter().all(u8::is_ascii_graphic) {
        return Some(
            "the token holds a character that is not printable ASCII or is a space; tokens \
             are printable ASCII without spaces"
                .to_owned(),
        );
    }
    None
}

/// Whether `a` and `b` are the same token, in time that depends on neither (every byte up to
/// [`REMORA_MAX_TOKEN`] is looked at, whatever the lengths and wherever they differ). Tokens
/// longer than that are never equal to anything.
pub fn tokens_equal(a: &[u8], b: &[u8]) -> bool {
    let max = REMORA_MAX_TOKEN as usize;
    let mut diff = u64::from(a.len() > max || b.len() > max);
    diff |= (a.len() ^ b.len()) as u64;
    for i in 0..max {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    // Keeps the compiler from turning the loop into one that stops at the first difference.
    std::hint::black_box(diff) == 0
}

/// Why a secret file (a token file) cannot be used. The messages name the file, never its
/// contents.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecretFileError {
    /// The file does not exist.
    #[error("the token file {0} does not exist: create it (mode 0600) or name another one")]
    Missing(PathBuf),
    /// It is not a regular file.
    #[error("the token file {0} is not a regular file: name a file (mode 0600)")]
    NotAFile(PathBuf),
    /// Group or others may read or write it.
    #[error(
        "the token file {path} may be read or written by group or others (mode {mode:04o}), so \
         its tokens may already be known to others: make it private with `chmod 600 {path}` \
         (and replace the tokens if others could read them)"
    )]
    TooOpen {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// It could not be read.
    #[error("cannot read the token file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// It is larger than a token file can be.
    #[error("the token file {path} is larger than {max} bytes; it is not a token file")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The bound.
        max: u64,
    },
    /// It holds no token.
    #[error(
        "the token file {0} is empty: write the token (or, for a server, `TENANT TOKEN` lines) into it"
    )]
    Empty(PathBuf),
    /// Its contents are not valid.
    #[error("the token file {path}, line {line}: {problem}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// The line (1-based).
        line: usize,
        /// What is wrong (never the token).
        problem: String,
    },
}

/// Largest token file read: 1 MiB (a server's list of many tenants).
pub const MAX_SECRET_FILE: u64 = 1 << 20;

/// Reads `path`, refusing it (like ssh does for keys) unless it is a regular file that group
/// and others can neither read nor write, and at most [`MAX_SECRET_FILE`] bytes long.
pub fn read_private_file(path: &Path) -> Result<String, SecretFileError> {
    use std::io::Read as _;
    use std::os::unix::fs::PermissionsExt;
    let read_err = |source| SecretFileError::Read {
        path: path.to_owned(),
        source,
    };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(SecretFileError::Missing(path.to_owned()));
        }
        Err(e) => return Err(read_err(e)),
    };
    // The checks are made on the file opened, not on the path again.
    let meta = file.metadata().map_err(read_err)?;
    if !meta.is_file() {
        return Err(SecretFileError::NotAFile(path.to_owned()));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(SecretFileError::TooOpen {
            path: path.to_owned(),
            mode,
        });
    }
    if meta.len() > MAX_SECRET_FILE {
        return Err(SecretFileError::TooLarge {
            path: path.to_owned(),
            max: MAX_SECRET_FILE,
        });
    }
    let mut text = String::new();
    file.take(MAX_SECRET_FILE + 1)
        .read_to_string(&mut text)
        .map_err(read_err)?;
    if text.len() as u64 > MAX_SECRET_FILE {
        return Err(SecretFileError::TooLarge {
            path: path.to_owned(),
            max: MAX_SECRET_FILE,
        });
    }
    Ok(text)
}

/// Reads a client's token file: a private file ([`read_private_file`]) holding just the
/// token (surrounding white space and one trailing newline are ignored).
pub fn read_token_file(path: &Path) -> Result<String, SecretFileError> {
    let text = read_private_file(path)?;
    let token = text.trim();
    if token.is_empty() {
        return Err(SecretFileError::Empty(path.to_owned()));
    }
    if let Some(problem) = token_problem(token.as_bytes()) {
        return Err(SecretFileError::Malformed {
            path: path.to_owned(),
            line: 1 + text[..text.find(token).unwrap_or(0)].matches('\n').count(),
            problem,
        });
    }
    Ok(token.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_tokens_compare_equal_and_others_do_not() {
        assert!(tokens_equal(b"0123456789abcdef", b"0123456789abcdef"));
        assert!(!tokens_equal(b"0123456789abcdef", b"0123456789abcdeg"));
        assert!(!tokens_equal(b"0123456789abcdef", b"0123456789abcde"));
        assert!(!tokens_equal(b"0123456789abcde", b"0123456789abcdef"));
        assert!(!tokens_equal(b"", b"0123456789abcdef"));
        // A trailing NUL must not pass for the shorter token.
        assert!(!tokens_equal(b"0123456789abcdef\0", b"0123456789abcdef"));
        let long = vec![b'a'; 300];
        assert!(!tokens_equal(&long, &long), "over-long tokens never match");
    }

    #[test]
    fn token_syntax_is_checked_without_quoting_the_token() {
        assert!(token_problem(b"0123456789abcdef").is_none());
        let short = token_problem(b"secret").unwrap();
        assert!(
            short.contains("at least 16") && !short.contains("secret"),
            "{short}"
        );
        assert!(token_problem(b"0123456789 abcdef").is_some());
        assert!(token_problem("0123456789abcdeé".as_bytes()).is_some());
        assert!(token_problem(&[b'x'; 257]).is_some());
    }

    fn write(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn token_files_must_be_private_present_and_hold_a_token() {
        let dir = std::env::temp_dir().join(format!("remora-token-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = write(&dir, "good", "0123456789abcdef\n", 0o600);
        assert_eq!(read_token_file(&good).unwrap(), "0123456789abcdef");
        for mode in [0o640, 0o604, 0o620, 0o602, 0o644] {
            let open = write(&dir, "open", "0123456789abcdef\n", mode);
            let e = read_token_file(&open).unwrap_err();
            assert!(
                matches!(e, SecretFileError::TooOpen { .. }),
                "{mode:o}: {e}"
            );
            assert!(e.to_string().contains("chmod 600"), "{e}");
        }
        let e = read_token_file(&dir.join("absent")).unwrap_err();
        assert!(matches!(e, SecretFileError::Missing(_)), "{e}");
        let e = read_token_file(&write(&dir, "empty", "\n \n", 0o600)).unwrap_err();
        assert!(matches!(e, SecretFileError::Empty(_)), "{e}");
        let e = read_token_file(&write(&dir, "short", "\nsecret\n", 0o600)).unwrap_err();
        assert!(
            matches!(e, SecretFileError::Malformed { line: 2, .. })
                && !e.to_string().contains("secret"),
            "{e}"
        );
        let e = read_token_file(&dir).unwrap_err();
        assert!(
            matches!(
                e,
                SecretFileError::NotAFile(_) | SecretFileError::Read { .. }
            ),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
