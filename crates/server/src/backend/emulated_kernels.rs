//! CPU implementations of the project's own test kernels, for the EMULATED test backend.
//!
//! CI has no GPU, but it must still check that a launch arrives intact: the parameter layout
//! the client packs (every scalar width, structs by value, a dozen parameters, `extra`), the
//! grid and block shape, and the stream order. So the emulated backend runs, on the CPU, the
//! kernels of `gpu/tests/vecadd_kernel.cu` and `gpu/tests/multikernel_kernel.cu` that need
//! neither shared memory nor atomics, found by name. Each checks the parameter layout it is
//! given against the kernel's C signature, so a wrong packing fails loudly instead of
//! computing garbage. Any other kernel fails with `CUDA_ERROR_NOT_SUPPORTED` and a log line
//! that names the emulated backend and the kernels it knows.

use remora_proto::cuda::{CuError, CuResult, cu};

/// Device memory as the emulated backend keeps it.
pub(crate) trait Memory {
    /// `len` bytes at device address `ptr`.
    fn read(&mut self, ptr: u64, len: u64) -> CuResult<Vec<u8>>;
    /// Writes `data` at device address `ptr`.
    fn write(&mut self, ptr: u64, data: &[u8]) -> CuResult<()>;
}

/// One launch: its shape and its packed parameters.
pub(crate) struct Launch<'a> {
    pub(crate) name: &'a str,
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
    pub(crate) params: &'a [u8],
    pub(crate) layout: &'a [(u32, u32)],
}

/// `fn u32(&self, i)` and the like: parameter `i` read as that type, little-endian.
macro_rules! le_readers {
    ($($t:ident),*) => {
        $(fn $t(&self, i: usize) -> CuResult<$t> {
            Ok($t::from_le_bytes(self.bytes(i)?))
        })*
    };
}

impl Launch<'_> {
    /// Checks the parameter sizes against the kernel's signature.
    fn expect(&self, sizes: &[u32]) -> CuResult<()> {
        let got: Vec<u32> = self.layout.iter().map(|(_, s)| *s).collect();
        if got != sizes {
            tracing::error!(
                kernel = self.name,
                "emulated test backend: the launch's parameter sizes {got:?} do not match the kernel's signature {sizes:?}"
            );
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(())
    }

    /// Parameter `i`'s bytes.
    fn raw(&self, i: usize) -> CuResult<&[u8]> {
        let (off, size) = *self.layout.get(i).ok_or(CuError(cu::INVALID_VALUE))?;
        let start = off as usize;
        self.params
            .get(start..start + size as usize)
            .ok_or(CuError(cu::INVALID_VALUE))
    }

    fn bytes<const N: usize>(&self, i: usize) -> CuResult<[u8; N]> {
        self.raw(i)?
            .get(..N)
            .and_then(|b| b.try_into().ok())
            .ok_or(CuError(cu::INVALID_VALUE))
    }

    // Parameter `i` as each scalar type, little-endian.
    le_readers!(u64, i64, i32, u32, i16, i8, u8, f32, f64);

    /// The number of threads along x over the whole grid (1-D kernels).
    fn threads_x(&self) -> u64 {
        u64::from(self.grid[0]) * u64::from(self.block[0])
    }
}

/// A CPU kernel.
type Kernel = fn(&Launch<'_>, &mut dyn Memory) -> CuResult<()>;

/// The kernels the emulated backend runs, by name.
const KERNELS: &[(&str, Kernel)] = &[
    ("vecadd", vecadd),
    ("fill_i32", fill_i32),
    ("iota_u64", iota_u64),
    ("saxpy", axpy::<f32>),
    ("daxpy", axpy::<f64>),
    ("small_types", small_types),
    ("by_struct", by_struct),
    ("many_params", many_params),
    ("grid3d", grid3d),
    ("large_param", large_param),
    // `remora bench launch`'s empty kernel (crates/gpubench), so the launch path's own cost
    // can be measured without a GPU.
    ("remora_bench_empty", |_, _| Ok(())),
];

/// Runs kernel `l.name` on the CPU.
pub(crate) fn run(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    match KERNELS.iter().find(|(n, _)| *n == l.name) {
        Some((_, k)) => k(l, mem),
        None => {
            let known: Vec<&str> = KERNELS.iter().map(|(n, _)| *n).collect();
            tracing::warn!(
                kernel = l.name,
                "emulated test backend: no CPU implementation of this kernel; it runs only the project's test kernels ({}) — CUDA_ERROR_NOT_SUPPORTED",
                known.join(", ")
            );
            Err(CuError(cu::NOT_SUPPORTED))
        }
    }
}

fn read_f32(mem: &mut dyn Memory, ptr: u64, n: u64) -> CuResult<Vec<f32>> {
    Ok(mem
        .read(ptr, n * 4)?
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// How many elements `i < n` a 1-D launch covers.
fn covered(l: &Launch<'_>, n: i32) -> u64 {
    l.threads_x().min(u64::try_from(n).unwrap_or(0))
}

/// `vecadd(const float *a, const float *b, float *c, int n)`.
fn vecadd(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    l.expect(&[8, 8, 8, 4])?;
    let m = covered(l, l.i32(3)?);
    let a = read_f32(mem, l.u64(0)?, m)?;
    let b = read_f32(mem, l.u64(1)?, m)?;
    let c: Vec<u8> = a
        .iter()
        .zip(&b)
        .flat_map(|(x, y)| (x + y).to_le_bytes())
        .collect();
    mem.write(l.u64(2)?, &c)
}

/// `fill_i32(int *p, int v, int n)`: `p[i] = v + i`.
fn fill_i32(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    l.expect(&[8, 4, 4])?;
    let v = l.i32(1)?;
    fill_covered(l, mem, |i| v.wrapping_add(i as i32).to_le_bytes())
}

/// `iota_u64(unsigned long long *p, unsigned long long base, int n)`: `p[i] = base + 3i`.
fn iota_u64(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    l.expect(&[8, 8, 4])?;
    let base = l.u64(1)?;
    fill_covered(l, mem, |i| base.wrapping_add(i * 3).to_le_bytes())
}

/// For a kernel `(T *p, T x, int n)`: `p[i] = at(i)` for each `i < n` the launch covers.
fn fill_covered<B: IntoIterator<Item = u8>>(
    l: &Launch<'_>,
    mem: &mut dyn Memory,
    at: impl Fn(u64) -> B,
) -> CuResult<()> {
    let m = covered(l, l.i32(2)?);
    let out: Vec<u8> = (0..m).flat_map(at).collect();
    mem.write(l.u64(0)?, &out)
}

/// A floating-point element type of the axpy kernels.
trait Float: Copy + std::ops::Mul<Output = Self> + std::ops::Add<Output = Self> {
    const SIZE: u32;
    fn from_le(b: &[u8]) -> Self;
    fn to_le(self) -> Vec<u8>;
}

macro_rules! float {
    ($($t:ty),*) => {$(
        impl Float for $t {
            const SIZE: u32 = std::mem::size_of::<$t>() as u32;
            fn from_le(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().unwrap_or([0; std::mem::size_of::<$t>()]))
            }
            fn to_le(self) -> Vec<u8> {
                self.to_le_bytes().to_vec()
            }
        }
    )*};
}

float!(f32, f64);

/// `saxpy(float a, const float *x, float *y, int n)` and `daxpy` (double): `y = a x + y`.
fn axpy<T: Float>(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    l.expect(&[T::SIZE, 8, 8, 4])?;
    let a = T::from_le(l.raw(0)?);
    let m = covered(l, l.i32(3)?);
    let len = u64::from(T::SIZE);
    let x = mem.read(l.u64(1)?, m * len)?;
    let y = mem.read(l.u64(2)?, m * len)?;
    let out: Vec<u8> = x
        .chunks_exact(T::SIZE as usize)
        .zip(y.chunks_exact(T::SIZE as usize))
        .flat_map(|(x, y)| (a * T::from_le(x) + T::from_le(y)).to_le())
        .collect();
    mem.write(l.u64(2)?, &out)
}

/// `small_types(signed char c, short s, unsigned char u, signed char *pc, short *ps, int n)`:
/// `pc[i] = c + i; ps[i] = s * i + u`.
fn small_types(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    l.expect(&[1, 2, 1, 8, 8, 4])?;
    let (c, s, u) = (l.i8(0)?, l.i16(1)?, l.u8(2)?);
    let m = covered(l, l.i32(5)?);
    let pc: Vec<u8> = (0..m).map(|i| c.wrapping_add(i as i8) as u8).collect();
    let ps: Vec<u8> = (0..m)
        .flat_map(|i| {
            s.wrapping_mul(i as i16)
                .wrapping_add(i16::from(u))
                .to_le_bytes()
        })
        .collect();
    mem.write(l.u64(3)?, &pc)?;
    mem.write(l.u64(4)?, &ps)
}

/// `by_struct(Mixed m, double *out)` with `struct Mixed { char c; double d; int i; short s; }`
/// (24 bytes by value: c at 0, d at 8, i at 16, s at 20): `out[0] = c + d + i + s`.
fn by_struct(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    l.expect(&[24, 8])?;
    let (off, _) = l.layout[0];
    let m = l
        .params
        .get(off as usize..off as usize + 24)
        .ok_or(CuError(cu::INVALID_VALUE))?;
    let c = f64::from(m[0] as i8);
    let d = f64::from_le_bytes(
        m[8..16]
            .try_into()
            .map_err(|_| CuError(cu::INVALID_VALUE))?,
    );
    let i = f64::from(i32::from_le_bytes(
        m[16..20]
            .try_into()
            .map_err(|_| CuError(cu::INVALID_VALUE))?,
    ));
    let s = f64::from(i16::from_le_bytes(
        m[20..22]
            .try_into()
            .map_err(|_| CuError(cu::INVALID_VALUE))?,
    ));
    mem.write(l.u64(1)?, &(c + d + i + s).to_le_bytes())
}

/// `many_params(int a, long long b, float c, double d, char e, short f, unsigned g,
/// unsigned long long h, float i, int *p1, double *p2, int j)`:
/// `p1[0] = a + b + e + f + g + h + j` (as int), `p2[0] = c + d + i`.
fn many_params(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    l.expect(&[4, 8, 4, 8, 1, 2, 4, 8, 4, 8, 8, 4])?;
    let sum = l
        .i32(0)?
        .wrapping_add(l.i64(1)? as i32)
        .wrapping_add(i32::from(l.i8(4)?))
        .wrapping_add(i32::from(l.i16(5)?))
        .wrapping_add(l.u32(6)? as i32)
        .wrapping_add(l.u64(7)? as i32)
        .wrapping_add(l.i32(11)?);
    let f = f64::from(l.f32(2)?) + l.f64(3)? + f64::from(l.f32(8)?);
    mem.write(l.u64(9)?, &sum.to_le_bytes())?;
    mem.write(l.u64(10)?, &f.to_le_bytes())
}

/// `large_param(struct { unsigned v[N]; } big, unsigned long long *out)` with a parameter of
/// more than 4 KiB (CUDA 12.1+ allows 32,764 bytes, as NVIDIA's LargeKernelParameter sample
/// uses): `out[0]` = the wrapping sum of the words of `big`.
fn large_param(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    let [(_, big), (_, 8)] = l.layout else {
        return l.expect(&[4104, 8]);
    };
    let sum = l
        .raw(0)?
        .chunks_exact(4)
        .map(|w| u64::from(u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
        .fold(0u64, u64::wrapping_add);
    tracing::debug!(bytes = big, "emulated large_param");
    mem.write(l.u64(1)?, &sum.to_le_bytes())
}

/// `grid3d(unsigned *out)`: every thread of a 3-D grid of 3-D blocks writes its coordinates
/// at its linear id.
fn grid3d(l: &Launch<'_>, mem: &mut dyn Memory) -> CuResult<()> {
    l.expect(&[8])?;
    let [gx, gy, gz] = l.grid;
    let [bx, by, bz] = l.block;
    let per_block = u64::from(bx) * u64::from(by) * u64::from(bz);
    let total = per_block * u64::from(gx) * u64::from(gy) * u64::from(gz);
    if total > 1 << 24 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let mut out = vec![0u32; total as usize];
    for z in 0..gz {
        for y in 0..gy {
            for x in 0..gx {
                let block =
                    u64::from(x) + u64::from(gx) * (u64::from(y) + u64::from(gy) * u64::from(z));
                for tz in 0..bz {
                    for ty in 0..by {
                        for tx in 0..bx {
                            let t = u64::from(tx)
                                + u64::from(bx) * (u64::from(ty) + u64::from(by) * u64::from(tz));
                            out[(block * per_block + t) as usize] =
                                (z << 24) | (y << 16) | (tz << 12) | (ty << 8) | (x << 4) | tx;
                        }
                    }
                }
            }
        }
    }
    let bytes: Vec<u8> = out.iter().flat_map(|v| v.to_le_bytes()).collect();
    mem.write(l.u64(0)?, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Flat(Vec<u8>);
    impl Memory for Flat {
        fn read(&mut self, ptr: u64, len: u64) -> CuResult<Vec<u8>> {
            Ok(self.0[ptr as usize..(ptr + len) as usize].to_vec())
        }
        fn write(&mut self, ptr: u64, data: &[u8]) -> CuResult<()> {
            self.0[ptr as usize..ptr as usize + data.len()].copy_from_slice(data);
            Ok(())
        }
    }

    #[test]
    fn a_wrong_layout_is_refused_and_an_unknown_kernel_is_not_supported() {
        let mut mem = Flat(vec![0; 64]);
        let params = [0u8; 16];
        let l = Launch {
            name: "fill_i32",
            grid: [1, 1, 1],
            block: [4, 1, 1],
            params: &params,
            layout: &[(0, 8), (8, 4)],
        };
        assert_eq!(run(&l, &mut mem), Err(CuError(cu::INVALID_VALUE)));
        let l = Launch { name: "nope", ..l };
        assert_eq!(run(&l, &mut mem), Err(CuError(cu::NOT_SUPPORTED)));
    }

    #[test]
    fn fill_covers_only_the_threads_launched() {
        let mut mem = Flat(vec![0xff; 64]);
        let mut params = [0u8; 16];
        params[..8].copy_from_slice(&8u64.to_le_bytes());
        params[8..12].copy_from_slice(&100i32.to_le_bytes());
        params[12..16].copy_from_slice(&10i32.to_le_bytes());
        let l = Launch {
            name: "fill_i32",
            grid: [1, 1, 1],
            block: [3, 1, 1],
            params: &params,
            layout: &[(0, 8), (8, 4), (12, 4)],
        };
        run(&l, &mut mem).unwrap();
        let v: Vec<i32> = mem.0[8..24]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(
            v,
            [100, 101, 102, -1],
            "3 threads, the 4th element untouched"
        );
    }
}
