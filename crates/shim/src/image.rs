//! The size of a kernel image given only its address (`cuModuleLoadData` takes a pointer):
//! the fatbin wrapper, a fatbin container, an ELF64 cubin, or NUL-terminated PTX. The image
//! itself is never interpreted beyond these headers; the server's driver loads it.

use crate::state::non_null;
use remora_client::{CuError, CuResult, cu};

/// `__fatBinC_Wrapper_t` magic.
pub const FATBINC_MAGIC: u32 = 0x466243B1;
/// Fatbin container magic.
pub const FATBIN_MAGIC: u32 = 0xBA55ED50;
const MAX_IMAGE: u64 = 256 << 20;

fn rd<const N: usize>(p: *const u8, off: usize) -> [u8; N] {
    let mut b = [0u8; N];
    // SAFETY: callers only read header fields that lie inside the image, whose start the
    // CUDA caller guarantees is readable; `read_unaligned` copes with any alignment.
    unsafe { std::ptr::copy_nonoverlapping(p.add(off), b.as_mut_ptr(), N) };
    b
}
fn u16_at(p: *const u8, off: usize) -> u64 {
    u64::from(u16::from_le_bytes(rd(p, off)))
}
fn u32_at(p: *const u8, off: usize) -> u64 {
    u64::from(u32::from_le_bytes(rd(p, off)))
}
fn u64_at(p: *const u8, off: usize) -> u64 {
    u64::from_le_bytes(rd(p, off))
}

fn bounded(size: u64) -> CuResult<usize> {
    if size == 0 || size > MAX_IMAGE {
        tracing::error!("remora: kernel image size {size} is out of range (1..=256 MiB)");
        return Err(CuError(cu::INVALID_IMAGE));
    }
    Ok(size as usize)
}

/// Finds the image bytes at `ptr`: the start (the wrapper's data pointer for a wrapped
/// fatbin) and the length.
///
/// # Safety
/// `ptr` is a kernel image as `cuModuleLoadData` accepts: readable for the whole image that
/// its headers describe (or up to and including the NUL of PTX text).
pub unsafe fn locate(ptr: *const u8) -> CuResult<(*const u8, usize)> {
    non_null(ptr)?;
    match u32_at(ptr, 0) as u32 {
        FATBINC_MAGIC => {
            let data = u64_at(ptr, 8) as usize as *const u8;
            if data.is_null() || u32_at(data, 0) as u32 != FATBIN_MAGIC {
                return Err(CuError(cu::INVALID_IMAGE));
            }
            Ok((data, fatbin_size(data)?))
        }
        FATBIN_MAGIC => Ok((ptr, fatbin_size(ptr)?)),
        0x464C_457F => Ok((ptr, elf_size(ptr)?)),
        _ => {
            // PTX: NUL-terminated text.
            // SAFETY: the caller guarantees PTX text is NUL-terminated and readable.
            let len = unsafe { std::ffi::CStr::from_ptr(ptr.cast()) }
                .to_bytes()
                .len() as u64;
            Ok((ptr, bounded(len + 1)?))
        }
    }
}

/// headerSize + fatSize of the first container.
fn fatbin_size(p: *const u8) -> CuResult<usize> {
    let header = u16_at(p, 6);
    let fat = u64_at(p, 8);
    bounded(header.checked_add(fat).ok_or(CuError(cu::INVALID_IMAGE))?)
}

/// The largest of: the ELF header, the program- and section-header tables, and every
/// section's and segment's file extent.
fn elf_size(p: *const u8) -> CuResult<usize> {
    if rd::<1>(p, 4)[0] != 2 || rd::<1>(p, 5)[0] != 1 {
        tracing::error!("remora: only little-endian ELF64 kernel images are supported");
        return Err(CuError(cu::INVALID_IMAGE));
    }
    let phoff = u64_at(p, 0x20);
    let shoff = u64_at(p, 0x28);
    let ehsize = u16_at(p, 0x34);
    let phentsize = u16_at(p, 0x36);
    let phnum = u16_at(p, 0x38);
    let shentsize = u16_at(p, 0x3A);
    let shnum = u16_at(p, 0x3C);
    let mut end = ehsize.max(64);
    let ph_end = phoff.saturating_add(phentsize * phnum);
    let sh_end = shoff.saturating_add(shentsize * shnum);
    if ph_end > MAX_IMAGE || sh_end > MAX_IMAGE {
        return Err(CuError(cu::INVALID_IMAGE));
    }
    if phnum > 0 {
        end = end.max(ph_end);
        for i in 0..phnum {
            let e = (phoff + i * phentsize) as usize;
            end = end.max(u64_at(p, e + 8).saturating_add(u64_at(p, e + 0x20)));
        }
    }
    if shnum > 0 {
        end = end.max(sh_end);
        for i in 0..shnum {
            let e = (shoff + i * shentsize) as usize;
            const SHT_NOBITS: u64 = 8;
            if u32_at(p, e + 4) != SHT_NOBITS {
                end = end.max(u64_at(p, e + 0x18).saturating_add(u64_at(p, e + 0x20)));
            }
        }
    }
    bounded(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fatbin(payload: usize) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&FATBIN_MAGIC.to_le_bytes());
        v.extend_from_slice(&1u16.to_le_bytes());
        v.extend_from_slice(&16u16.to_le_bytes());
        v.extend_from_slice(&(payload as u64).to_le_bytes());
        v.extend(std::iter::repeat_n(0xAB, payload));
        v
    }

    #[test]
    fn fatbin_container() {
        let mut v = fatbin(100);
        v.extend_from_slice(&[0xEE; 50]); // trailing bytes are not part of the image
        // SAFETY: a well-formed container within `v`.
        let (p, n) = unsafe { locate(v.as_ptr()) }.unwrap();
        assert_eq!((p, n), (v.as_ptr(), 116));
    }

    #[test]
    fn fatbin_wrapper_points_at_the_container() {
        let inner = fatbin(40);
        let mut w = Vec::new();
        w.extend_from_slice(&FATBINC_MAGIC.to_le_bytes());
        w.extend_from_slice(&1u32.to_le_bytes());
        w.extend_from_slice(&(inner.as_ptr() as u64).to_le_bytes());
        w.extend_from_slice(&0u64.to_le_bytes());
        // SAFETY: the wrapper points to a well-formed container.
        let (p, n) = unsafe { locate(w.as_ptr()) }.unwrap();
        assert_eq!((p, n), (inner.as_ptr(), 56));
    }

    #[test]
    fn elf64_extent() {
        // Header (64) + 1 program header at 64 (56 bytes) + section data + 3 section headers.
        let mut v = vec![0u8; 64];
        v[0..4].copy_from_slice(b"\x7fELF");
        v[4] = 2;
        v[5] = 1;
        let phoff = 64u64;
        let shoff = 400u64;
        v[0x20..0x28].copy_from_slice(&phoff.to_le_bytes());
        v[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        v[0x34..0x36].copy_from_slice(&64u16.to_le_bytes());
        v[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        v[0x38..0x3A].copy_from_slice(&1u16.to_le_bytes());
        v[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        v[0x3C..0x3E].copy_from_slice(&3u16.to_le_bytes());
        v.resize(400 + 3 * 64, 0);
        // Program header: offset 120, filesz 100.
        v[64 + 8..64 + 16].copy_from_slice(&120u64.to_le_bytes());
        v[64 + 0x20..64 + 0x28].copy_from_slice(&100u64.to_le_bytes());
        // Section 1: PROGBITS at 200, 50 bytes. Section 2: NOBITS claiming a huge size.
        let s1 = 400 + 64;
        v[s1 + 4..s1 + 8].copy_from_slice(&1u32.to_le_bytes());
        v[s1 + 0x18..s1 + 0x20].copy_from_slice(&200u64.to_le_bytes());
        v[s1 + 0x20..s1 + 0x28].copy_from_slice(&50u64.to_le_bytes());
        let s2 = 400 + 128;
        v[s2 + 4..s2 + 8].copy_from_slice(&8u32.to_le_bytes());
        v[s2 + 0x18..s2 + 0x20].copy_from_slice(&300u64.to_le_bytes());
        v[s2 + 0x20..s2 + 0x28].copy_from_slice(&100000u64.to_le_bytes());
        // SAFETY: all headers lie within `v`.
        assert_eq!(unsafe { locate(v.as_ptr()) }.unwrap().1, 592);
        // A section past the table extends the image.
        v[s1 + 0x18..s1 + 0x20].copy_from_slice(&600u64.to_le_bytes());
        v.resize(650, 0);
        // SAFETY: as above.
        assert_eq!(unsafe { locate(v.as_ptr()) }.unwrap().1, 650);
    }

    #[test]
    fn ptx_text_and_bad_images() {
        let ptx = b".version 8.0\n.target sm_90\n\0garbage";
        // SAFETY: NUL-terminated.
        assert_eq!(unsafe { locate(ptx.as_ptr()) }.unwrap().1, 28);
        // SAFETY: null is rejected before any read.
        let null = unsafe { locate(std::ptr::null()) };
        assert_eq!(null, Err(CuError(cu::INVALID_VALUE)));
        let mut big = fatbin(0);
        big[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        // SAFETY: only the header is read.
        let huge = unsafe { locate(big.as_ptr()) };
        assert_eq!(huge, Err(CuError(cu::INVALID_IMAGE)));
        // SAFETY: an empty PTX string is just its NUL.
        assert_eq!(unsafe { locate(c"".as_ptr().cast()) }.unwrap().1, 1);
    }
}
