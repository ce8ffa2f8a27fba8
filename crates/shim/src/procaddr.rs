//! cuGetProcAddress: a requested name, CUDA version and flags to the exported variant.

use std::ffi::c_void;

use crate::generated::{PROC_TABLE, symbol_address};

/// `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
pub const PER_THREAD_DEFAULT_STREAM: u64 = 2;
/// `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`.
pub const SYMBOL_NOT_FOUND: i32 = 1;
/// `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`.
pub const VERSION_NOT_SUFFICIENT: i32 = 2;

/// The symbol `name` resolves to for `version` and `flags`, or the
/// `CUdriverProcAddressQueryResult` explaining why not.
pub fn resolve_name(name: &str, version: i32, flags: u64) -> Result<&'static str, i32> {
    let version = u32::try_from(version).unwrap_or(0);
    let per_thread = flags & PER_THREAD_DEFAULT_STREAM != 0;
    let rows: Vec<&(&str, u32, bool, &str)> = PROC_TABLE.iter().filter(|r| r.0 == name).collect();
    if rows.is_empty() {
        return Err(SYMBOL_NOT_FOUND);
    }
    let best = |ptds: bool| {
        rows.iter()
            .filter(|r| r.2 == ptds && r.1 <= version)
            .max_by_key(|r| r.1)
            .map(|r| r.3)
    };
    let found = if per_thread {
        best(true).or_else(|| best(false))
    } else {
        best(false)
    };
    found.ok_or(VERSION_NOT_SUFFICIENT)
}

/// [`resolve_name`] to an address.
pub fn resolve(name: &str, version: i32, flags: u64) -> Result<*mut c_void, i32> {
    let sym = resolve_name(name, version, flags)?;
    symbol_address(sym).ok_or(SYMBOL_NOT_FOUND)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_variant_by_version_and_flags() {
        let cases = [
            ("cuMemAlloc", 13000, 0, Ok("cuMemAlloc_v2")),
            ("cuMemAlloc", 2000, 0, Ok("cuMemAlloc")),
            ("cuCtxCreate", 12000, 0, Ok("cuCtxCreate_v3")),
            ("cuCtxCreate", 13000, 0, Ok("cuCtxCreate_v4")),
            ("cuEventElapsedTime", 12080, 0, Ok("cuEventElapsedTime_v2")),
            ("cuEventElapsedTime", 12000, 0, Ok("cuEventElapsedTime")),
            ("cuMemcpyHtoD", 13000, 2, Ok("cuMemcpyHtoD_v2_ptds")),
            ("cuMemcpyHtoD", 13000, 1, Ok("cuMemcpyHtoD_v2")),
            ("cuLaunchKernel", 13000, 2, Ok("cuLaunchKernel_ptsz")),
            ("cuInit", 13000, 2, Ok("cuInit")),
            ("cuGetProcAddress", 13000, 0, Ok("cuGetProcAddress_v2")),
            ("cuNoSuchThing", 13000, 0, Err(SYMBOL_NOT_FOUND)),
            ("cuLaunchKernelEx", 11000, 0, Err(VERSION_NOT_SUFFICIENT)),
        ];
        for (name, version, flags, want) in cases {
            assert_eq!(
                resolve_name(name, version, flags),
                want,
                "{name} {version} {flags}"
            );
        }
    }

    #[test]
    fn every_entry_point_resolves_to_an_address_stubs_included() {
        for name in crate::generated::ALL {
            assert!(symbol_address(name).is_some(), "{name}");
        }
        assert!(resolve("cuGraphAddMemAllocNode", 13000, 0).is_ok());
        assert_eq!(
            resolve("cuMemAlloc", 13000, 0).unwrap(),
            crate::exports::cuMemAlloc_v2 as *const () as *mut c_void
        );
    }
}
