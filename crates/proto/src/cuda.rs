//! `CUresult` codes as a Rust error, and the table of every code's name and text: the one error
//! type of the client, the shim and the server (a `CUresult` travels on the wire as it is).

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fmt;
use std::sync::OnceLock;

/// Every `CUresult` code by name (`CUDA_ERROR_INVALID_VALUE` is `cu::INVALID_VALUE`), generated
/// by `build.rs` from the same table as [`cu_results`].
pub mod cu {
    include!(concat!(env!("OUT_DIR"), "/cu.rs"));
}

/// `pub const`s of a CUDA enum, each documented with its full name in `cuda.h`: the enum's
/// `$prefix` and the constant's own name, then the note in parentheses, if any.
///
/// ```
/// pub mod capture_status {
///     remora_proto::cuda_consts!(i32, "CU_STREAM_CAPTURE_STATUS_" {
///         NONE = 0,
///         ACTIVE = 1 ("capturing"),
///     });
/// }
/// assert_eq!(capture_status::ACTIVE, 1);
/// ```
#[macro_export]
macro_rules! cuda_consts {
    ($ty:ty, $prefix:literal { $($name:ident = $value:literal $(($note:literal))?,)* }) => {
        $(#[doc = concat!("`", $prefix, stringify!($name), "`", $(" (", $note, ")",)? ".")]
        pub const $name: $ty = $value;)*
    };
}

/// A CUDA driver error: the `CUresult` code (never 0).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CuError(pub i32);

/// `Result<T, CuError>`.
pub type CuResult<T> = Result<T, CuError>;

impl CuError {
    /// The `CUresult` code.
    pub fn code(self) -> i32 {
        self.0
    }

    /// `Ok(())` for CUDA_SUCCESS, else the error.
    pub fn check(code: i32) -> CuResult<()> {
        if code == cu::SUCCESS {
            Ok(())
        } else {
            Err(CuError(code))
        }
    }

    /// Whether the CUDA context is unusable after this error: CUDA keeps returning it, so a
    /// server session does too.
    pub fn is_sticky(self) -> bool {
        matches!(self.0, 214 | 700 | 710 | 714..=719)
    }
}

impl fmt::Debug for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CuError({}, {})",
            self.0,
            cu_result_name(self.0).unwrap_or("?")
        )
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (cu_result_name(self.0), cu_result_string(self.0)) {
            (Some(name), Some(text)) => write!(f, "{name} ({}): {text}", self.0),
            _ => write!(f, "unknown CUresult {}", self.0),
        }
    }
}

impl std::error::Error for CuError {}

struct Entry {
    name: CString,
    text: CString,
}

type Row = (i32, &'static str, &'static str);
type Table = (Vec<Row>, HashMap<i32, Entry>);

fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut rows = Vec::new();
        let mut map = HashMap::new();
        for line in include_str!("cu_results.txt").lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let mut parts = line.splitn(3, ' ');
            let (Some(code), Some(name), Some(text)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let Ok(code) = code.parse::<i32>() else {
                continue;
            };
            rows.push((code, name, text));
            map.insert(
                code,
                Entry {
                    name: CString::new(name).unwrap_or_default(),
                    text: CString::new(text).unwrap_or_default(),
                },
            );
        }
        (rows, map)
    })
}

/// Every `CUresult` of CUDA 13.0's `cuda.h`: code, name, text.
pub fn cu_results() -> &'static [(i32, &'static str, &'static str)] {
    &table().0
}

/// The name of a `CUresult` (`"CUDA_ERROR_INVALID_VALUE"`), as `cuGetErrorName`.
pub fn cu_result_name(code: i32) -> Option<&'static str> {
    cu_result_name_c(code).and_then(|c| c.to_str().ok())
}

/// The text of a `CUresult`, as `cuGetErrorString`.
pub fn cu_result_string(code: i32) -> Option<&'static str> {
    cu_result_string_c(code).and_then(|c| c.to_str().ok())
}

/// [`cu_result_name`] as a static NUL-terminated string, for C callers.
pub fn cu_result_name_c(code: i32) -> Option<&'static CStr> {
    table().1.get(&code).map(|e| e.name.as_c_str())
}

/// [`cu_result_string`] as a static NUL-terminated string, for C callers.
pub fn cu_result_string_c(code: i32) -> Option<&'static CStr> {
    table().1.get(&code).map(|e| e.text.as_c_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_every_code_once_and_known_entries() {
        let rows = cu_results();
        assert!(rows.len() > 95, "{} rows", rows.len());
        let mut codes: Vec<i32> = rows.iter().map(|r| r.0).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), rows.len());
        assert_eq!(cu_result_name(0), Some("CUDA_SUCCESS"));
        assert_eq!(cu_result_name(100), Some("CUDA_ERROR_NO_DEVICE"));
        assert_eq!(cu_result_name(801), Some("CUDA_ERROR_NOT_SUPPORTED"));
        assert_eq!(cu_result_name(999), Some("CUDA_ERROR_UNKNOWN"));
        // The texts are NVIDIA's driver's own (captured by gpu/tools/error_strings.c).
        assert_eq!(cu_result_string(2), Some("out of memory"));
        assert_eq!(
            cu_result_string(700),
            Some("an illegal memory access was encountered")
        );
        assert_eq!(cu_result_name(12345), None);
        for (code, name) in [
            (cu::UNSUPPORTED_LIMIT, "CUDA_ERROR_UNSUPPORTED_LIMIT"),
            (cu::ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"),
            (cu::CONTEXT_IS_DESTROYED, "CUDA_ERROR_CONTEXT_IS_DESTROYED"),
            (cu::LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED"),
            (
                cu::STREAM_CAPTURE_INVALIDATED,
                "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            ),
            (
                cu::STREAM_CAPTURE_UNMATCHED,
                "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
            ),
        ] {
            assert_eq!(cu_result_name(code), Some(name));
        }
        for (_, name, text) in rows {
            assert!(name.starts_with("CUDA_"));
            assert!(!text.is_empty(), "{name} has no text");
        }
    }

    #[test]
    fn errors_print_their_name_code_and_text() {
        assert_eq!(
            CuError(1).to_string(),
            format!(
                "CUDA_ERROR_INVALID_VALUE (1): {}",
                cu_result_string(1).unwrap()
            )
        );
        assert_eq!(
            format!("{:?}", CuError(801)),
            "CuError(801, CUDA_ERROR_NOT_SUPPORTED)"
        );
    }
}
