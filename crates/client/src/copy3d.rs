//! The geometry of 2-D and 3-D copies (`cuMemcpy2D`, `cuMemcpy3D`, `cuMemcpy3DPeer`) on the
//! client: where a copy's rows lie in pitched memory, packing a host region into the buffer
//! that travels and scattering a packed buffer back, and splitting a large copy into bands
//! that each fit in one call.
//!
//! A copy of `width × height × depth` bytes reads row `r` of slice `k` at
//! `((z + k) * side_height + y + r) * pitch + x` from its side's base, as CUDA does. The packed
//! form of a region is its rows back to back (pitch = width, height = the copy's height).

use crate::error::{CuError, CuResult, cu};

/// The size of a 2-D or 3-D copy (`WidthInBytes`, `Height`, `Depth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Bytes per row.
    pub width: u64,
    /// Rows per slice.
    pub height: u64,
    /// Slices (1 for a 2-D copy).
    pub depth: u64,
}

impl Extent {
    /// Bytes copied; `None` on overflow.
    pub fn bytes(&self) -> Option<u64> {
        self.width.checked_mul(self.height)?.checked_mul(self.depth)
    }

    /// Whether nothing is copied.
    pub fn is_empty(&self) -> bool {
        self.width == 0 || self.height == 0 || self.depth == 0
    }
}

/// Where a copy's region lies in one side's memory: `srcXInBytes`, `srcY`, `srcZ`, `srcPitch`
/// and `srcHeight` of a `CUDA_MEMCPY3D` (the `dst*` fields for a destination).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Layout {
    /// Offset of the region in a row, bytes.
    pub x: u64,
    /// First row.
    pub y: u64,
    /// First slice.
    pub z: u64,
    /// Bytes per row.
    pub pitch: u64,
    /// Rows per slice (only used when the depth is more than 1; may be 0 otherwise).
    pub height: u64,
}

impl Layout {
    /// The packed layout of a copy of extent `e`.
    pub fn packed(e: &Extent) -> Layout {
        Layout {
            x: 0,
            y: 0,
            z: 0,
            pitch: e.width,
            height: e.height,
        }
    }

    /// Offset from the base of row `r` of slice `k`.
    fn row(&self, k: u64, r: u64) -> Option<u64> {
        self.z
            .checked_add(k)?
            .checked_mul(self.height)?
            .checked_add(self.y.checked_add(r)?)?
            .checked_mul(self.pitch)?
            .checked_add(self.x)
    }

    /// Checks the layout for a copy of extent `e` as CUDA does (the pitch is at least the
    /// width; with more than one slice, the height is at least the copy's) and returns the
    /// byte offsets `(first, end)` the copy touches: every row lies between the first row's
    /// start and the last row's end. CUDA_ERROR_INVALID_VALUE when it does not hold or the
    /// offsets overflow. `e` must not be empty.
    pub fn span(&self, e: &Extent) -> CuResult<(u64, u64)> {
        if e.is_empty() || self.pitch < e.width || (e.depth > 1 && self.height < e.height) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let first = self.row(0, 0);
        let end = self
            .row(e.depth - 1, e.height - 1)
            .and_then(|l| l.checked_add(e.width));
        match (first, end) {
            (Some(first), Some(end)) => Ok((first, end)),
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    /// The offset of each row of a copy of extent `e`, slice by slice: the packed order.
    /// The layout must have passed [`Layout::span`] for `e`.
    pub fn rows(&self, e: &Extent) -> impl Iterator<Item = u64> + use<> {
        let l = *self;
        let e = *e;
        (0..e.depth).flat_map(move |k| (0..e.height).map(move |r| l.row(k, r).unwrap_or(u64::MAX)))
    }

    /// The layout of the part of a copy that starts `b`'s offsets into it.
    pub fn band(&self, b: &Band) -> Layout {
        Layout {
            x: self.x.saturating_add(b.dx),
            y: self.y.saturating_add(b.dy),
            z: self.z.saturating_add(b.dz),
            ..*self
        }
    }
}

/// Gathers the region `l`/`e` of `base` into a packed buffer. `base` must hold the whole span
/// (CUDA_ERROR_INVALID_VALUE otherwise).
pub fn pack(base: &[u8], l: &Layout, e: &Extent) -> CuResult<Vec<u8>> {
    let (_, end) = l.span(e)?;
    let total = e.bytes().ok_or(CuError(cu::INVALID_VALUE))?;
    if end > base.len() as u64 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let w = e.width as usize;
    let mut out = Vec::with_capacity(total as usize);
    for off in l.rows(e) {
        let off = off as usize;
        out.extend_from_slice(&base[off..off + w]);
    }
    Ok(out)
}

/// Scatters packed rows into the region `l`/`e` of `base`. Only whole rows present in
/// `packed` are written (a failed asynchronous copy delivers none). `base` must hold the whole
/// span (CUDA_ERROR_INVALID_VALUE otherwise).
pub fn unpack(packed: &[u8], base: &mut [u8], l: &Layout, e: &Extent) -> CuResult<()> {
    let (_, end) = l.span(e)?;
    if end > base.len() as u64 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let w = e.width as usize;
    for (off, row) in l.rows(e).zip(packed.chunks_exact(w)) {
        let off = off as usize;
        base[off..off + w].copy_from_slice(row);
    }
    Ok(())
}

/// A part of a copy: its offsets into the copy (bytes in a row, rows, slices) and its extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Band {
    /// Offset in a row, bytes.
    pub dx: u64,
    /// First row.
    pub dy: u64,
    /// First slice.
    pub dz: u64,
    /// Its size.
    pub extent: Extent,
}

/// Splits a copy into bands of at most `limit` bytes each: whole slices when a slice fits,
/// else runs of rows of one slice, else pieces of one row. In order; together they cover the
/// copy exactly once. An empty extent gives no band.
pub fn bands(e: &Extent, limit: u64) -> Vec<Band> {
    let limit = limit.max(1);
    let mut out = Vec::new();
    if e.is_empty() {
        return out;
    }
    let slice = e.width.saturating_mul(e.height);
    if slice <= limit {
        let per = (limit / slice).max(1);
        let mut z = 0;
        while z < e.depth {
            let n = per.min(e.depth - z);
            out.push(Band {
                dx: 0,
                dy: 0,
                dz: z,
                extent: Extent { depth: n, ..*e },
            });
            z += n;
        }
        return out;
    }
    for z in 0..e.depth {
        if e.width <= limit {
            let per = limit / e.width;
            let mut y = 0;
            while y < e.height {
                let n = per.min(e.height - y);
                out.push(Band {
                    dx: 0,
                    dy: y,
                    dz: z,
                    extent: Extent {
                        width: e.width,
                        height: n,
                        depth: 1,
                    },
                });
                y += n;
            }
        } else {
            for y in 0..e.height {
                let mut x = 0;
                while x < e.width {
                    let n = limit.min(e.width - x);
                    out.push(Band {
                        dx: x,
                        dy: y,
                        dz: z,
                        extent: Extent {
                            width: n,
                            height: 1,
                            depth: 1,
                        },
                    });
                    x += n;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(width: u64, height: u64, depth: u64) -> Extent {
        Extent {
            width,
            height,
            depth,
        }
    }

    #[test]
    fn span_checks_pitch_height_and_overflow() {
        let l = Layout {
            x: 3,
            y: 2,
            z: 1,
            pitch: 10,
            height: 6,
        };
        // first row: (1*6 + 2)*10 + 3 = 83; last: ((1+1)*6 + 2 + 2)*10 + 3 = 163, + 4.
        assert_eq!(l.span(&ext(4, 3, 2)), Ok((83, 167)));
        assert!(l.span(&ext(11, 1, 1)).is_err(), "pitch < width");
        assert!(
            l.span(&ext(4, 7, 2)).is_err(),
            "height < rows with depth > 1"
        );
        assert!(
            l.span(&ext(4, 7, 1)).is_ok(),
            "height is unused for one slice"
        );
        let huge = Layout {
            pitch: u64::MAX / 2,
            ..l
        };
        assert!(huge.span(&ext(4, 3, 2)).is_err());
    }

    #[test]
    fn pack_then_unpack_round_trips_a_pitched_region() {
        let e = ext(3, 2, 2);
        let l = Layout {
            x: 1,
            y: 1,
            z: 0,
            pitch: 5,
            height: 4,
        };
        let base: Vec<u8> = (0..40).collect();
        let packed = pack(&base, &l, &e).unwrap();
        assert_eq!(packed, [6, 7, 8, 11, 12, 13, 26, 27, 28, 31, 32, 33]);
        let mut out = vec![0u8; 40];
        unpack(&packed, &mut out, &l, &e).unwrap();
        for (i, b) in out.iter().enumerate() {
            let inside = packed.contains(&(i as u8));
            assert_eq!(*b, if inside { i as u8 } else { 0 }, "byte {i}");
        }
        assert!(
            pack(&base[..33], &l, &e).is_err(),
            "base shorter than the span"
        );
        // A partial delivery writes whole rows only.
        let mut part = vec![0u8; 40];
        unpack(&packed[..4], &mut part, &l, &e).unwrap();
        assert_eq!(&part[6..9], &[6, 7, 8]);
        assert_eq!(part[11], 0);
    }

    #[test]
    fn bands_cover_the_copy_once_within_the_limit() {
        for (e, limit) in [
            (ext(7, 5, 3), 1000),
            (ext(7, 5, 3), 35),
            (ext(7, 5, 3), 36),
            (ext(7, 5, 3), 20),
            (ext(7, 5, 3), 6),
            (ext(1, 1, 1), 1),
        ] {
            let mut seen = vec![0u32; (e.width * e.height * e.depth) as usize];
            for b in bands(&e, limit) {
                assert!(b.extent.bytes().unwrap() <= limit, "{e:?} {limit} {b:?}");
                for z in 0..b.extent.depth {
                    for y in 0..b.extent.height {
                        for x in 0..b.extent.width {
                            let (x, y, z) = (b.dx + x, b.dy + y, b.dz + z);
                            seen[(z * e.height * e.width + y * e.width + x) as usize] += 1;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{e:?} {limit}");
        }
        assert!(bands(&ext(0, 5, 3), 10).is_empty());
        assert_eq!(bands(&ext(7, 5, 3), 1000).len(), 1);
    }
}
