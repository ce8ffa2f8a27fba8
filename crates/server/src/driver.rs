//! The real CUDA driver, loaded at run time.
//!
//! The server never links against `libcuda.so.1`: it `dlopen`s it when it starts, so a
//! machine without a GPU or driver still runs `remora serve` and reports zero devices with the
//! reason. The HELLO inventory: the driver is opened through the CUDA backend's loader
//! ([`crate::backend::cuda`]), which keeps one load per process for the backend to share.

use std::ffi::c_int;

use crate::backend::cuda::{self, LoadError, Loaded, need};

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

/// The driver library to load: `REMORA_REAL_LIBCUDA`, else [`DEFAULT_DRIVER_LIBRARY`].
pub fn driver_library() -> String {
    std::env::var("REMORA_REAL_LIBCUDA").unwrap_or_else(|_| DEFAULT_DRIVER_LIBRARY.into())
}

/// Loads the driver named by `REMORA_REAL_LIBCUDA` (default `libcuda.so.1`) and lists its
/// GPUs. Never panics; every failure becomes a reason string.
pub fn probe() -> Inventory {
    probe_library(&driver_library())
}

/// Like [`probe`], for an explicit library path. The library is opened through the CUDA
/// backend's loader, so the backend later shares this load (one `dlopen` per process).
pub fn probe_library(path: &str) -> Inventory {
    let lib = match cuda::open(path) {
        Ok(lib) => lib,
        Err(LoadError::NotFound(reason)) => return Inventory::NotFound(reason),
        Err(LoadError::InitFailed(reason)) => return Inventory::InitFailed(reason),
    };
    match inventory(&lib) {
        Ok((driver_version, devices)) => Inventory::Ok {
            driver_version,
            devices,
        },
        Err(reason) => Inventory::InitFailed(reason),
    }
}

fn inventory(lib: &Loaded) -> Result<(i32, Vec<GpuInfo>), String> {
    let version = need("cuDriverGetVersion", lib.driver_version())?;
    let count = need("cuDeviceGetCount", lib.device_count())?;
    let mut devices = Vec::with_capacity(count.clamp(0, 64) as usize);
    for ordinal in 0..count {
        let dev = need("cuDeviceGet", lib.device(ordinal))?;
        let total_memory = need("cuDeviceTotalMem", lib.total_mem(dev))?;
        let uuid = need("cuDeviceGetUuid", lib.uuid(dev))?;
        let attribute = |attr| need("cuDeviceGetAttribute", lib.attribute(attr, dev));
        devices.push(GpuInfo {
            ordinal,
            name: need("cuDeviceGetName", lib.name(dev))?,
            uuid,
            total_memory,
            compute_major: attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            compute_minor: attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            multiprocessor_count: attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            pci_bus_id: need("cuDeviceGetPCIBusId", lib.pci_bus_id(dev))?,
        });
    }
    Ok((version, devices))
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
