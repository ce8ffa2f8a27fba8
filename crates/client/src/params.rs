//! Kernel parameter packing: the bytes `cuLaunchKernel` sends, laid out at the offsets the
//! server reported for the function (`cuFuncGetParamInfo`), or taken from an `extra` buffer.

use std::ffi::c_void;

use remora_proto::remora::{RM_MAX_PARAMS, RmParam};

use crate::error::{CuError, CuResult, cu};

/// `CU_LAUNCH_PARAM_END`.
pub const CU_LAUNCH_PARAM_END: usize = 0x00;
/// `CU_LAUNCH_PARAM_BUFFER_POINTER`.
pub const CU_LAUNCH_PARAM_BUFFER_POINTER: usize = 0x01;
/// `CU_LAUNCH_PARAM_BUFFER_SIZE`.
pub const CU_LAUNCH_PARAM_BUFFER_SIZE: usize = 0x02;

/// The size of the packed parameter buffer of `layout`: the end of its last parameter.
pub fn packed_size(layout: &[RmParam]) -> usize {
    layout
        .iter()
        .map(|p| p.offset as usize + p.size as usize)
        .max()
        .unwrap_or(0)
}

/// Packs parameters: `value(i)` gives the bytes of parameter `i`, which must be exactly
/// `layout[i].size` long (else CUDA_ERROR_INVALID_VALUE).
pub fn pack_with<'a>(
    layout: &[RmParam],
    mut value: impl FnMut(usize) -> &'a [u8],
) -> CuResult<Vec<u8>> {
    let size = packed_size(layout);
    if size > RM_MAX_PARAMS as usize {
        tracing::error!(
            "kernel parameters take {size} bytes, more than the protocol's {RM_MAX_PARAMS}"
        );
        return Err(CuError(cu::INVALID_VALUE));
    }
    let mut out = vec![0u8; size];
    for (i, p) in layout.iter().enumerate() {
        let bytes = value(i);
        if bytes.len() != p.size as usize {
            return Err(CuError(cu::INVALID_VALUE));
        }
        out[p.offset as usize..p.offset as usize + bytes.len()].copy_from_slice(bytes);
    }
    Ok(out)
}

/// Packs `kernelParams` (an array of one pointer per parameter) at `layout`'s offsets.
///
/// # Safety
/// `kernel_params` is null only if `layout` is empty; otherwise it points to
/// `layout.len()` pointers, each valid for reads of its parameter's size.
pub unsafe fn pack_kernel_params(
    layout: &[RmParam],
    kernel_params: *const *const c_void,
) -> CuResult<Vec<u8>> {
    if layout.is_empty() {
        return Ok(Vec::new());
    }
    if kernel_params.is_null() {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let mut bad = false;
    let out = pack_with(layout, |i| {
        // SAFETY: the caller guarantees `kernel_params` holds `layout.len()` pointers.
        let p = unsafe { *kernel_params.add(i) };
        if p.is_null() {
            bad = true;
            return &[];
        }
        // SAFETY: the caller guarantees each pointer is valid for its parameter's size; the
        // slice lives only for this copy.
        unsafe { std::slice::from_raw_parts(p.cast::<u8>(), layout[i].size as usize) }
    });
    if bad {
        return Err(CuError(cu::INVALID_VALUE));
    }
    out
}

/// Copies the parameter buffer out of an `extra` array
/// (`CU_LAUNCH_PARAM_BUFFER_POINTER, p, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END`).
///
/// # Safety
/// `extra` points to a `CU_LAUNCH_PARAM_END`-terminated array of key/value pointer pairs as
/// `cuLaunchKernel` documents; the buffer pointer is valid for reads of the size given.
pub unsafe fn pack_extra(extra: *const *const c_void) -> CuResult<Vec<u8>> {
    let mut buffer: *const u8 = std::ptr::null();
    let mut size: Option<usize> = None;
    let mut i = 0;
    loop {
        // SAFETY: the caller guarantees the array runs to CU_LAUNCH_PARAM_END; we stop there.
        let key = unsafe { *extra.add(i) } as usize;
        match key {
            CU_LAUNCH_PARAM_END => break,
            CU_LAUNCH_PARAM_BUFFER_POINTER => {
                // SAFETY: a key other than END is followed by its value.
                buffer = unsafe { *extra.add(i + 1) }.cast();
            }
            CU_LAUNCH_PARAM_BUFFER_SIZE => {
                // SAFETY: as above; the value points to a size_t.
                let p = unsafe { *extra.add(i + 1) }.cast::<usize>();
                if p.is_null() {
                    return Err(CuError(cu::INVALID_VALUE));
                }
                // SAFETY: the caller guarantees it points to a readable size_t.
                size = Some(unsafe { p.read_unaligned() });
            }
            _ => return Err(CuError(cu::INVALID_VALUE)),
        }
        i += 2;
        if i > 64 {
            return Err(CuError(cu::INVALID_VALUE));
        }
    }
    let Some(size) = size else {
        return Err(CuError(cu::INVALID_VALUE));
    };
    if size > RM_MAX_PARAMS as usize || (buffer.is_null() && size > 0) {
        return Err(CuError(cu::INVALID_VALUE));
    }
    if size == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the caller guarantees the buffer is readable for `size` bytes.
    Ok(unsafe { std::slice::from_raw_parts(buffer, size) }.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(v: &[(u32, u32)]) -> Vec<RmParam> {
        v.iter()
            .map(|&(offset, size)| RmParam { offset, size })
            .collect()
    }

    #[test]
    fn packs_kernel_params_at_their_offsets_with_padding() {
        // (char c, double d, int i): offsets 0, 8, 16.
        let l = layout(&[(0, 1), (8, 8), (16, 4)]);
        let c = 7u8;
        let d = 1.5f64;
        let i = -2i32;
        let ptrs: [*const c_void; 3] = [
            (&c as *const u8).cast(),
            (&d as *const f64).cast(),
            (&i as *const i32).cast(),
        ];
        // SAFETY: three valid pointers to values of the layout's sizes.
        let out = unsafe { pack_kernel_params(&l, ptrs.as_ptr()) }.unwrap();
        assert_eq!(out.len(), 20);
        assert_eq!(out[0], 7);
        assert_eq!(&out[1..8], &[0; 7]);
        assert_eq!(&out[8..16], &1.5f64.to_ne_bytes());
        assert_eq!(&out[16..20], &(-2i32).to_ne_bytes());
    }

    #[test]
    fn empty_layout_and_null_params() {
        // SAFETY: an empty layout reads nothing.
        let empty = unsafe { pack_kernel_params(&[], std::ptr::null()) };
        assert_eq!(empty.unwrap(), Vec::<u8>::new());
        // SAFETY: a non-empty layout with null params is rejected before any read.
        let err = unsafe { pack_kernel_params(&layout(&[(0, 4)]), std::ptr::null()) };
        assert_eq!(err, Err(CuError(cu::INVALID_VALUE)));
    }

    #[test]
    fn pack_with_rejects_wrong_sizes_and_oversized_layouts() {
        let l = layout(&[(0, 4)]);
        assert!(pack_with(&l, |_| &[1, 2]).is_err());
        assert_eq!(pack_with(&l, |_| &[1, 2, 3, 4]).unwrap(), vec![1, 2, 3, 4]);
        assert!(pack_with(&layout(&[(RM_MAX_PARAMS, 4)]), |_| &[0; 4]).is_err());
    }

    #[test]
    fn packs_extra_buffers() {
        let buf = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let size: usize = 8;
        let extra: [*const c_void; 5] = [
            CU_LAUNCH_PARAM_BUFFER_POINTER as *const c_void,
            buf.as_ptr().cast(),
            CU_LAUNCH_PARAM_BUFFER_SIZE as *const c_void,
            (&size as *const usize).cast(),
            CU_LAUNCH_PARAM_END as *const c_void,
        ];
        // SAFETY: a well-formed extra array.
        assert_eq!(unsafe { pack_extra(extra.as_ptr()) }.unwrap(), buf.to_vec());
        let bad: [*const c_void; 3] = [
            7 as *const c_void,
            std::ptr::null(),
            CU_LAUNCH_PARAM_END as *const c_void,
        ];
        // SAFETY: terminated; the unknown key is rejected.
        assert!(unsafe { pack_extra(bad.as_ptr()) }.is_err());
        let no_size: [*const c_void; 3] = [
            CU_LAUNCH_PARAM_BUFFER_POINTER as *const c_void,
            buf.as_ptr().cast(),
            CU_LAUNCH_PARAM_END as *const c_void,
        ];
        // SAFETY: terminated; a missing size is rejected.
        assert!(unsafe { pack_extra(no_size.as_ptr()) }.is_err());
    }
}
