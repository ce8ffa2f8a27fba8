//! Where the client connects by default.

use std::path::PathBuf;

use remora_oncrpc::Endpoint;

use crate::error::{CuError, cu};

/// The default server endpoint, as `remora serve` listens by default:
/// `$XDG_RUNTIME_DIR/remora/remora.sock`, or `/tmp/remora-$UID/remora.sock` without one.
pub fn default_endpoint() -> Endpoint {
    let dir = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("remora"),
        _ => {
            use std::os::unix::fs::MetadataExt;
            let uid = std::fs::metadata("/proc/self")
                .map(|m| m.uid())
                .unwrap_or(0);
            PathBuf::from(format!("/tmp/remora-{uid}"))
        }
    };
    Endpoint::Unix(dir.join("remora.sock"))
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
