//! Transport failures as `CUresult`s, with their cause kept.
//!
//! A CUDA program only understands `CUresult` codes, so an RPC failure has to become one: a lost
//! or refused connection, a call that timed out, or a server that stopped answering is
//! CUDA_ERROR_DEVICE_UNAVAILABLE, anything
//! else CUDA_ERROR_UNKNOWN. The code alone says nothing about what went wrong, so the cause is
//! logged and kept: [`last_transport_failure`] returns the latest one (the Rust API), and the
//! shim's `cuGetErrorString` appends it to the code's text, so a program that prints
//! `cudaGetErrorString` shows why its remote GPU went away.

use std::sync::Mutex;
use std::time::SystemTime;

use remora_oncrpc::RpcError;
pub use remora_proto::cuda::{
    CuError, CuResult, cu, cu_result_name, cu_result_name_c, cu_result_string, cu_result_string_c,
    cu_results,
};

/// A remote call that failed in transport: which call, why, and the code it was reported as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportFailure {
    /// The procedure, e.g. `RM_MEMCPY_HTOD`.
    pub call: String,
    /// The transport's error, as text (e.g. "connection lost").
    pub cause: String,
    /// The `CUresult` the call returned: DEVICE_UNAVAILABLE or UNKNOWN.
    pub code: i32,
    /// When it happened.
    pub at: SystemTime,
}

static LAST: Mutex<Option<TransportFailure>> = Mutex::new(None);

/// The latest transport failure of this process, if any call failed in transport.
pub fn last_transport_failure() -> Option<TransportFailure> {
    LAST.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Maps an RPC failure to a `CUresult`, logging it and keeping it as the
/// [`last_transport_failure`]: a lost or refused connection, or a timeout, becomes
/// CUDA_ERROR_DEVICE_UNAVAILABLE (the remote GPU is gone), anything else CUDA_ERROR_UNKNOWN.
pub fn from_rpc(what: &str, err: RpcError) -> CuError {
    let code = match err {
        RpcError::ConnectionLost
        | RpcError::Connect { .. }
        | RpcError::Timeout { .. }
        | RpcError::ServerUnresponsive { .. } => cu::DEVICE_UNAVAILABLE,
        _ => cu::UNKNOWN,
    };
    // The session names calls by their generated method (`rm_mem_alloc`); the protocol's
    // documents name the procedure (`RM_MEM_ALLOC`).
    let what = what.to_ascii_uppercase();
    tracing::error!(
        "remora: {what} failed in transport, reported as {}: {err}",
        cu_result_name(code).unwrap_or("?")
    );
    *LAST.lock().unwrap_or_else(|e| e.into_inner()) = Some(TransportFailure {
        call: what,
        cause: err.to_string(),
        code,
        at: SystemTime::now(),
    });
    CuError(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_errors_map_to_cuda_codes_and_keep_their_cause() {
        assert_eq!(
            from_rpc("RM_TEST", RpcError::ConnectionLost),
            CuError(cu::DEVICE_UNAVAILABLE)
        );
        let last = last_transport_failure().expect("recorded");
        assert_eq!(last.call, "RM_TEST");
        assert_eq!(last.code, cu::DEVICE_UNAVAILABLE);
        assert_eq!(last.cause, RpcError::ConnectionLost.to_string());
        assert_eq!(
            from_rpc(
                "RM_CTX_SYNCHRONIZE",
                RpcError::ServerUnresponsive {
                    silent: std::time::Duration::from_secs(15)
                }
            ),
            CuError(cu::DEVICE_UNAVAILABLE),
            "a hung server is a device gone"
        );
        assert_eq!(
            from_rpc(
                "RM_OTHER",
                RpcError::ProcUnavail {
                    program: 1,
                    version: 1,
                    procedure: 9
                }
            ),
            CuError(cu::UNKNOWN)
        );
        let last = last_transport_failure().expect("recorded");
        assert_eq!((last.call.as_str(), last.code), ("RM_OTHER", cu::UNKNOWN));
        assert!(last.cause.contains('9'), "{}", last.cause);
    }
}
