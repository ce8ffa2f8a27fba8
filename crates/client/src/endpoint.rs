//! Where the client connects by default.

use remora_oncrpc::{Endpoint, TransportChoice};

use crate::error::{CuError, cu};

/// The default server endpoint, where `remora serve` listens by default:
/// `$XDG_RUNTIME_DIR/remora/remora.sock`, or `/tmp/remora-$UID/remora.sock` without one.
pub fn default_endpoint() -> Endpoint {
    Endpoint::default_local()
}

/// The endpoint named by `REMORA_SERVER` (`tcp://HOST:PORT`, `tls://HOST:PORT` or
/// `unix:///PATH`), else
/// [`default_endpoint`]. A malformed `REMORA_SERVER` is an error (CUDA_ERROR_INVALID_VALUE),
/// logged with the reason, rather than silently replaced by the default.
pub fn endpoint_from_env() -> Result<Endpoint, CuError> {
    match std::env::var("REMORA_SERVER") {
        Ok(url) if !url.trim().is_empty() => url.trim().parse().map_err(|e| {
            tracing::error!("REMORA_SERVER is not a valid server address: {e}");
            CuError(cu::INVALID_VALUE)
        }),
        _ => Ok(default_endpoint()),
    }
}

/// The transport named by `REMORA_TRANSPORT` (`auto`, `shm`, `unix` or `tcp`; unset or empty:
/// `auto`, which is shared memory for a `unix://` server on this host and TCP for a `tcp://`
/// one). A malformed value is an error (CUDA_ERROR_INVALID_VALUE), logged with the reason.
pub fn transport_from_env() -> Result<TransportChoice, CuError> {
    match std::env::var("REMORA_TRANSPORT") {
        Ok(v) if !v.trim().is_empty() => v.parse().map_err(|e| {
            tracing::error!("REMORA_TRANSPORT is not valid: {e}");
            CuError(cu::INVALID_VALUE)
        }),
        _ => Ok(TransportChoice::Auto),
    }
}

/// A token that authenticates the client to a server started with `--auth-token-file`
/// (sent in `REMORA_HELLO_AUTH`). `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthToken(String);

impl std::fmt::Debug for AuthToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthToken(<not shown>)")
    }
}

impl AuthToken {
    /// `token`, if it is a valid token (at least 16 printable ASCII characters, no spaces);
    /// otherwise why not (the message never quotes the token).
    pub fn new(token: &str) -> Result<Self, String> {
        match remora_proto::token::token_problem(token.as_bytes()) {
            Some(problem) => Err(problem),
            None => Ok(Self(token.to_owned())),
        }
    }

    /// The token's bytes, for the wire.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

/// The token named by the environment: `REMORA_AUTH_TOKEN` (the token itself), else
/// `REMORA_AUTH_TOKEN_FILE` (a file of mode 0600 holding it, as `remora run
/// --auth-token-file` passes it); `None` when neither is set. A set but unusable one is an
/// error (CUDA_ERROR_INVALID_VALUE), logged with the reason and never the token.
pub fn auth_token_from_env() -> Result<Option<AuthToken>, CuError> {
    if let Some(v) = std::env::var_os("REMORA_AUTH_TOKEN").filter(|v| !v.is_empty()) {
        let token = v.to_str().map(str::trim).unwrap_or_default();
        return AuthToken::new(token).map(Some).map_err(|problem| {
            tracing::error!("remora: REMORA_AUTH_TOKEN is not a valid token: {problem}");
            CuError(cu::INVALID_VALUE)
        });
    }
    let Some(path) = std::env::var_os("REMORA_AUTH_TOKEN_FILE").filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    let token = remora_proto::token::read_token_file(std::path::Path::new(&path)).map_err(|e| {
        tracing::error!("remora: REMORA_AUTH_TOKEN_FILE: {e}");
        CuError(cu::INVALID_VALUE)
    })?;
    AuthToken::new(&token).map(Some).map_err(|problem| {
        tracing::error!("remora: REMORA_AUTH_TOKEN_FILE: {problem}");
        CuError(cu::INVALID_VALUE)
    })
}
