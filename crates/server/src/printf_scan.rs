//! Whether a module image may call device-side `printf`, for the completion-word
//! synchronize (`RM_STREAM_SIGNAL`): NVIDIA's driver writes a kernel's printf output only
//! inside the call that synchronizes, so a session whose kernels may print must make that
//! call on the server. Conservative: an image this cannot read through (a compressed fatbin
//! entry, an unknown format) may print.
//!
//! Device `printf` compiles to a call of the external function `vprintf`, whose name is in
//! the image: in PTX text (`.extern .func ... vprintf`) and in a cubin's symbol table. A
//! fatbin (header magic `0xBA55ED50`, then entries each with a kind, a header size and a
//! payload size) is read through when every payload is plain: an ELF image or text (PTX).

/// Whether `image` (PTX, cubin or fatbin, as `cuModuleLoadData` takes it) may print.
pub(crate) fn may_print(image: &[u8]) -> bool {
    if contains(image, b"vprintf") {
        return true;
    }
    if image.starts_with(b"\x7fELF") || is_text(image) {
        return false;
    }
    match fatbin_plain(image) {
        Some(plain) => !plain,
        None => true,
    }
}

const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// Substring search at memory speed: the scan runs on every module load, and PyTorch loads
/// tens of megabytes of images at start-up.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(hay, needle).is_some()
}

/// Text (PTX, or the emulated backend's test modules): printable ASCII throughout, but
/// for NUL terminators at the end. Nothing compressed looks like that.
fn is_text(b: &[u8]) -> bool {
    let end = b.iter().rposition(|&c| c != 0).map_or(0, |i| i + 1);
    end > 0
        && b[..end]
            .iter()
            .all(|c| c.is_ascii_graphic() || c.is_ascii_whitespace())
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// `Some(true)` when `b` is a fatbin (one container or several in a row, then at most zero
/// padding) whose every entry is an ELF image or PTX text, `Some(false)` when one is
/// something else (compressed), `None` when `b` is no fatbin or its headers do not add up.
fn fatbin_plain(b: &[u8]) -> Option<bool> {
    let mut pos = 0;
    let mut entries = 0;
    while pos < b.len() {
        if u32_at(b, pos) != Some(FATBIN_MAGIC) {
            if b[pos..].iter().all(|&c| c == 0) {
                break;
            }
            return None;
        }
        let header = usize::from(u16_at(b, pos + 6)?);
        let size = usize::try_from(u64_at(b, pos + 8)?).ok()?;
        let end = pos.checked_add(header)?.checked_add(size)?;
        if end > b.len() || header < 16 {
            return None;
        }
        let mut at = pos + header;
        while at < end {
            let entry_header = u32_at(b, at + 4)? as usize;
            let payload = usize::try_from(u64_at(b, at + 8)?).ok()?;
            if entry_header < 16 {
                return None;
            }
            let start = at.checked_add(entry_header)?;
            let stop = start.checked_add(payload)?;
            if stop > end {
                return None;
            }
            let body = &b[start..stop];
            if !(body.starts_with(b"\x7fELF") || is_text(body)) {
                return Some(false);
            }
            entries += 1;
            at = stop;
        }
        pos = end;
    }
    Some(entries > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fatbin(entries: &[&[u8]]) -> Vec<u8> {
        let mut body = Vec::new();
        for e in entries {
            body.extend_from_slice(&2u16.to_le_bytes());
            body.extend_from_slice(&0x101u16.to_le_bytes());
            body.extend_from_slice(&64u32.to_le_bytes());
            body.extend_from_slice(&(e.len() as u64).to_le_bytes());
            body.resize(body.len() + 48, 0);
            body.extend_from_slice(e);
        }
        let mut out = Vec::new();
        out.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        out.extend_from_slice(&1u16.to_le_bytes());
        out.extend_from_slice(&16u16.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    #[test]
    fn printing_and_unreadable_images_may_print_plain_silent_ones_do_not() {
        let ptx = b"//\n.version 8.0\n.target sm_80\n.visible .entry k()\n{\n\tret;\n}\n";
        let ptx_printf = b".version 8.0\n.extern .func (.param .b32 r) vprintf\n";
        let elf = b"\x7fELF\x02\x01\x01 code without the name";
        let elf_printf = b"\x7fELF\x02\x01\x01 .strtab vprintf";
        assert!(!may_print(ptx));
        assert!(may_print(ptx_printf));
        assert!(!may_print(elf));
        assert!(may_print(elf_printf));
        assert!(!may_print(&fatbin(&[elf, ptx])));
        assert!(may_print(&fatbin(&[elf, elf_printf])));
        // A compressed entry (binary from its first byte) cannot be read through.
        assert!(may_print(&fatbin(&[elf, b"\xf1\x7fELF compressed"])));
        // Text with a NUL terminator (as PTX reaches the server).
        assert!(!may_print(b".version 8.0\n\0"));
        assert!(!may_print(b"REMORA-EMU-MODULE\nfunc k 8\n"));
        // Nothing known: junk, an empty fatbin, headers that run past the image.
        assert!(may_print(b"\x00\x01\x02junk"));
        assert!(may_print(&fatbin(&[])));
        let mut cut = fatbin(&[elf]);
        cut.truncate(40);
        assert!(may_print(&cut));
        // Several containers, then padding: all are read; a compressed entry in the second
        // one counts.
        let mut two = fatbin(&[elf]);
        two.extend_from_slice(&fatbin(&[ptx]));
        two.extend_from_slice(&[0; 8]);
        assert!(!may_print(&two));
        let mut two = fatbin(&[elf]);
        two.extend_from_slice(&fatbin(&[b"\x28\xb5\x2f\xfd zstd"]));
        assert!(may_print(&two));
    }
}
