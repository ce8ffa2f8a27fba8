//! The real CUDA driver, loaded at run time.
//!
//! The server never links against `libcuda.so.1`: it `dlopen`s it when it starts, so a
//! machine without a GPU or driver still runs `remora serve` and reports zero devices with the
//! reason. Only the few queries the HELLO inventory needs live here for now.

use std::ffi::{CStr, c_char, c_int, c_uint};

use libloading::Library;
use remora_proto::cuda::cu;

const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;

/// The library name the server loads unless `REMORA_REAL_LIBCUDA` names another path.
pub const DEFAULT_DRIVER_LIBRARY: &str = "libcuda.so.1";

/// One GPU as the real driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// The real driver's ordinal.
    pub ordinal: i32,
    /// Marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// The device UUID.
    pub uuid: [u8; 16],
    /// Total device memory in bytes.
    pub total_memory: u64,
    /// Compute capability, major part.
    pub compute_major: i32,
    /// Compute capability, minor part.
    pub compute_minor: i32,
    /// Number of streaming multiprocessors.
    pub multiprocessor_count: i32,
    /// PCI bus id, e.g. "0000:3B:00.0".
    pub pci_bus_id: String,
}

/// What the server found when it looked for GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inventory {
    /// The driver loaded and initialised.
    Ok {
        /// `cuDriverGetVersion`, e.g. 13000.
        driver_version: i32,
        /// The devices, in ordinal order.
        devices: Vec<GpuInfo>,
    },
    /// The driver library could not be loaded.
    NotFound(String),
    /// The driver loaded but `cuInit` or a query failed.
    InitFailed(String),
}

/// Loads the driver named by `REMORA_REAL_LIBCUDA` (default `libcuda.so.1`) and lists its
/// GPUs. Never panics; every failure becomes a reason string.
pub fn probe() -> Inventory {
    let path =
        std::env::var("REMORA_REAL_LIBCUDA").unwrap_or_else(|_| DEFAULT_DRIVER_LIBRARY.into());
    probe_library(&path)
}

/// Like [`probe`], for an explicit library path.
pub fn probe_library(path: &str) -> Inventory {
    // SAFETY: loading a shared library runs its initialisers. The path names NVIDIA's CUDA
    // driver (or an operator-chosen replacement via REMORA_REAL_LIBCUDA); its initialisers
    // are designed to run in any process that loads it.
    let lib = match unsafe { Library::new(path) } {
        Ok(lib) => lib,
        Err(e) => {
            let mut detail = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                detail = format!("{detail}: {s}");
                source = s.source();
            }
            return Inventory::NotFound(format!(
                "could not load the CUDA driver {path} ({detail}). Install the NVIDIA driver, \
                 or set REMORA_REAL_LIBCUDA to its path"
            ));
        }
    };
    match Driver::new(&lib).and_then(|d| d.inventory()) {
        Ok((driver_version, devices)) => Inventory::Ok {
            driver_version,
            devices,
        },
        Err(reason) => Inventory::InitFailed(reason),
    }
}

type FnInit = unsafe extern "C" fn(c_uint) -> c_int;
type FnOutInt = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type FnDeviceString = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type FnTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type FnUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_int;
type FnAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type FnErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// The driver entry points the inventory uses, resolved once.
struct Driver {
    init: FnInit,
    driver_get_version: FnOutInt,
    device_get_count: FnOutInt,
    device_get: FnDeviceGet,
    device_get_name: FnDeviceString,
    device_total_mem: FnTotalMem,
    device_get_uuid: FnUuid,
    device_get_attribute: FnAttribute,
    device_get_pci_bus_id: FnDeviceString,
    get_error_name: Option<FnErrorName>,
}

fn symbol<T: Copy>(lib: &Library, names: &[&str]) -> Result<T, String> {
    for name in names {
        let cname = format!("{name}\0");
        // SAFETY: every caller passes a function-pointer type `T` that matches the C
        // prototype of `name` in cuda.h (CUDA 13.0); the pointer is copied out and used only
        // while `lib` stays loaded (the Driver never outlives the Library it was built from).
        if let Ok(sym) = unsafe { lib.get::<T>(cname.as_bytes()) } {
            return Ok(*sym);
        }
    }
    Err(format!("the CUDA driver lacks {}", names.join(" / ")))
}

impl Driver {
    fn new(lib: &Library) -> Result<Self, String> {
        Ok(Self {
            init: symbol(lib, &["cuInit"])?,
            driver_get_version: symbol(lib, &["cuDriverGetVersion"])?,
            device_get_count: symbol(lib, &["cuDeviceGetCount"])?,
            device_get: symbol(lib, &["cuDeviceGet"])?,
            device_get_name: symbol(lib, &["cuDeviceGetName"])?,
            device_total_mem: symbol(lib, &["cuDeviceTotalMem_v2", "cuDeviceTotalMem"])?,
            device_get_uuid: symbol(lib, &["cuDeviceGetUuid_v2", "cuDeviceGetUuid"])?,
            device_get_attribute: symbol(lib, &["cuDeviceGetAttribute"])?,
            device_get_pci_bus_id: symbol(lib, &["cuDeviceGetPCIBusId"])?,
            get_error_name: symbol(lib, &["cuGetErrorName"]).ok(),
        })
    }

    fn check(&self, what: &str, rc: c_int) -> Result<(), String> {
        if rc == cu::SUCCESS {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        let known = self.get_error_name.is_some_and(|f| {
            // SAFETY: cuGetErrorName writes a pointer to a static NUL-terminated string
            // into `name`, or fails and leaves it untouched (null).
            unsafe { f(rc, &mut name) == cu::SUCCESS && !name.is_null() }
        });
        let label = if known {
            // SAFETY: checked non-null above; the driver's error names are static C strings.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown error".to_owned()
        };
        Err(format!("{what} failed with CUDA error {rc} ({label})"))
    }

    fn out_int(&self, what: &str, f: FnOutInt) -> Result<c_int, String> {
        let mut v: c_int = 0;
        // SAFETY: `f` is cuDriverGetVersion or cuDeviceGetCount, which write one int.
        self.check(what, unsafe { f(&mut v) })?;
        Ok(v)
    }

    fn string(&self, what: &str, f: FnDeviceString, dev: c_int) -> Result<String, String> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
        self.check(what, unsafe {
            f(buf.as_mut_ptr(), buf.len() as c_int, dev)
        })?;
        buf[buf.len() - 1] = 0;
        // SAFETY: `buf` is NUL-terminated (forced above) and lives for this call.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    fn attribute(&self, attr: c_int, dev: c_int) -> Result<c_int, String> {
        let mut v: c_int = 0;
        // SAFETY: cuDeviceGetAttribute writes one int for a valid attribute and device.
        self.check("cuDeviceGetAttribute", unsafe {
            (self.device_get_attribute)(&mut v, attr, dev)
        })?;
        Ok(v)
    }

    fn inventory(&self) -> Result<(i32, Vec<GpuInfo>), String> {
        // SAFETY: cuInit(0) takes no pointers.
        self.check("cuInit", unsafe { (self.init)(0) })?;
        let version = self.out_int("cuDriverGetVersion", self.driver_get_version)?;
        let count = self.out_int("cuDeviceGetCount", self.device_get_count)?;
        let mut devices = Vec::with_capacity(count.clamp(0, 64) as usize);
        for ordinal in 0..count {
            let mut dev: c_int = 0;
            // SAFETY: cuDeviceGet writes one CUdevice (an int) for a valid ordinal.
            self.check("cuDeviceGet", unsafe {
                (self.device_get)(&mut dev, ordinal)
            })?;
            let mut total: usize = 0;
            // SAFETY: cuDeviceTotalMem writes one size_t.
            self.check("cuDeviceTotalMem", unsafe {
                (self.device_total_mem)(&mut total, dev)
            })?;
            let mut uuid = [0u8; 16];
            // SAFETY: CUuuid is 16 bytes; the driver writes exactly that.
            self.check("cuDeviceGetUuid", unsafe {
                (self.device_get_uuid)(&mut uuid, dev)
            })?;
            devices.push(GpuInfo {
                ordinal,
                name: self.string("cuDeviceGetName", self.device_get_name, dev)?,
                uuid,
                total_memory: total as u64,
                compute_major: self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)?,
                compute_minor: self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)?,
                multiprocessor_count: self
                    .attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)?,
                pci_bus_id: self.string("cuDeviceGetPCIBusId", self.device_get_pci_bus_id, dev)?,
            });
        }
        Ok((version, devices))
    }
}

/// Keeps only the devices whose real ordinals are listed in `selection` (in that order) and
/// renumbers them from 0, as the client will see them. Unknown ordinals are an error.
pub fn select_devices(
    inventory: Inventory,
    selection: Option<&[i32]>,
) -> Result<Inventory, String> {
    let (
        Inventory::Ok {
            driver_version,
            devices,
        },
        Some(selection),
    ) = (&inventory, selection)
    else {
        return Ok(inventory);
    };
    let mut chosen = Vec::with_capacity(selection.len());
    for (new, want) in selection.iter().enumerate() {
        let Some(dev) = devices.iter().find(|d| d.ordinal == *want) else {
            return Err(format!(
                "--devices names GPU {want}, but the driver reports {} device(s) (0..{})",
                devices.len(),
                devices.len()
            ));
        };
        chosen.push(GpuInfo {
            ordinal: new as i32,
            ..dev.clone()
        });
    }
    Ok(Inventory::Ok {
        driver_version: *driver_version,
        devices: chosen,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_reports_a_reason() {
        match probe_library("/nonexistent/libcuda.so.1") {
            Inventory::NotFound(reason) => {
                assert!(reason.contains("/nonexistent/libcuda.so.1"), "{reason}");
                assert!(reason.contains("REMORA_REAL_LIBCUDA"), "{reason}");
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
    }

    #[test]
    fn a_library_without_cuda_symbols_is_init_failed() {
        // libc is loadable everywhere and has no cuInit.
        match probe_library("libc.so.6") {
            Inventory::InitFailed(reason) => assert!(reason.contains("cuInit"), "{reason}"),
            other => panic!("expected InitFailed, got {other:?}"),
        }
    }

    fn gpu(ordinal: i32) -> GpuInfo {
        GpuInfo {
            ordinal,
            name: format!("gpu{ordinal}"),
            uuid: [ordinal as u8; 16],
            total_memory: 1 << 30,
            compute_major: 9,
            compute_minor: 0,
            multiprocessor_count: 132,
            pci_bus_id: format!("0000:0{ordinal}:00.0"),
        }
    }

    #[test]
    fn device_selection_renumbers_and_rejects_unknown() {
        let inv = Inventory::Ok {
            driver_version: 13000,
            devices: vec![gpu(0), gpu(1), gpu(2)],
        };
        let Ok(Inventory::Ok { devices, .. }) = select_devices(inv.clone(), Some(&[2, 0])) else {
            panic!("selection failed")
        };
        assert_eq!(
            devices
                .iter()
                .map(|d| (d.ordinal, d.name.as_str()))
                .collect::<Vec<_>>(),
            [(0, "gpu2"), (1, "gpu0")]
        );
        let err = select_devices(inv, Some(&[5])).unwrap_err();
        assert!(err.contains("GPU 5"), "{err}");
    }
}
