//! The server's address-space layout: device ranges far from the clients' own mappings.
//!
//! Unified addressing makes the client reserve every device range at the address the server's
//! driver chose (`remora_client`'s `VaSpace`), so a device pointer is never also a host
//! pointer of the program. The CUDA driver places device allocations, and the large ranges it
//! reserves at context creation, with `mmap(NULL, ...)`: in the default (top-down) layout they
//! land just below the server's shared libraries, around `0x7f..`, the very region where the
//! client's own `mmap`s, thread stacks and glibc's 64 MiB per-thread malloc arenas go. Both
//! bases are randomized, so now and then a device range overlaps a host mapping of the client
//! and that allocation fails (the H100 suite saw a multithreaded program fail so once in about
//! ten runs). In the legacy bottom-up layout (`ADDR_COMPAT_LAYOUT`, what `setarch -L` sets)
//! the kernel hands out `mmap(NULL)` addresses upwards from a third of the address space
//! (`0x2aaa_aaab_0000` plus randomization), terabytes away from a client's top-down mappings;
//! observed on the H100: device allocations at `0x2b04..`, and everything else unchanged
//! (`gpu/tools/va_layout.c`).
//!
//! `remora serve` therefore re-executes itself once with that personality (worker processes
//! inherit it). `REMORA_SERVE_LAYOUT=default` keeps the default layout.

use std::ffi::OsString;

/// Set in the re-executed server's environment: at most one re-execution, whatever the
/// kernel made of the personality (it clears the flag when executing a set-user-ID binary).
const REEXEC_MARKER: &str = "REMORA_SERVE_LAYOUT_REEXEC";
/// `default` keeps the kernel's default (top-down) layout.
pub const LAYOUT_ENV: &str = "REMORA_SERVE_LAYOUT";

/// Asks for the persona without changing it (`personality(2)`: 0xffffffff queries).
const QUERY: libc::c_ulong = 0xffff_ffff;

/// Re-executes this process (same executable, same arguments) with the bottom-up address
/// layout unless it has it already, was re-executed already, or `REMORA_SERVE_LAYOUT=default`.
/// Returns only when no re-execution happened; call it first thing, before any thread starts.
/// A failure is logged and the server goes on in the default layout.
pub fn reexec_bottom_up() {
    if std::env::var_os(REEXEC_MARKER).is_some() {
        // SAFETY: called first thing in `main`, before any other thread exists, so nothing
        // reads the environment concurrently.
        unsafe { std::env::remove_var(REEXEC_MARKER) };
        if !has_bottom_up() {
            tracing::warn!(
                "the server still has the default address layout after re-executing itself (a set-user-ID binary?); device ranges may now and then collide with clients' host mappings"
            );
        }
        return;
    }
    if std::env::var(LAYOUT_ENV).is_ok_and(|v| v == "default") || has_bottom_up() {
        return;
    }
    // SAFETY: personality(2) with the current persona plus one flag changes only how the
    // kernel lays out the next executed image; it touches no memory of ours.
    let old = unsafe { libc::personality(QUERY) };
    if old < 0 {
        return;
    }
    // SAFETY: as above.
    let set = unsafe {
        libc::personality((old as libc::c_ulong) | libc::ADDR_COMPAT_LAYOUT as libc::c_ulong)
    };
    if set < 0 {
        tracing::debug!("personality(ADDR_COMPAT_LAYOUT) refused; keeping the default layout");
        return;
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return undo(old, &format!("cannot find the remora executable: {e}")),
    };
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let err = std::os::unix::process::CommandExt::exec(
        std::process::Command::new(&exe)
            .args(&args)
            .env(REEXEC_MARKER, "1"),
    );
    undo(old, &format!("cannot re-execute {}: {err}", exe.display()));
}

/// Whether this process runs with the bottom-up layout.
pub fn has_bottom_up() -> bool {
    // SAFETY: a query; changes nothing.
    let persona = unsafe { libc::personality(QUERY) };
    persona >= 0 && persona & libc::ADDR_COMPAT_LAYOUT != 0
}

fn undo(old: libc::c_int, why: &str) {
    // SAFETY: restores the persona read before; changes nothing else.
    unsafe { libc::personality(old as libc::c_ulong) };
    tracing::warn!("{why}; the server keeps the default address layout");
}
