//! Where the client connects by default.

use remora_oncrpc::{Endpoint, TransportChoice};

use crate::error::{CuError, cu};

/// The default server endpoint, where `remora serve` listens by default:
/// `$XDG_RUNTIME_DIR/remora/remora.sock`, or `/tmp/remora-$UID/remora.sock` without one.
pub fn default_endpoint() -> Endpoint {
    Endpoint::default_local()
}

/// The endpoint named by `REMORA_SERVER` (`tcp://HOST:PORT` or `unix:///PATH`), else
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
