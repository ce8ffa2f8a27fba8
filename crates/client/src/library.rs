//! Libraries (`CUlibrary`) and kernels (`CUkernel`) on top of module loading.
//!
//! A library keeps a copy of its image and is loaded as a module per context, on first use in
//! that context; a kernel names a function of the library by name and resolves to that
//! function in the calling context's module. Library and kernel ids are the client's own,
//! never server handles.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use remora_proto::remora::RmHandle;

use crate::error::{CuError, CuResult, cu};
use crate::session::ModuleInfo;

#[derive(Debug)]
struct Library {
    image: Arc<[u8]>,
    modules: HashMap<RmHandle, Arc<ModuleInfo>>,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    libraries: HashMap<u64, Library>,
    /// Kernel id -> (library id, function name).
    kernels: HashMap<u64, (u64, String)>,
    by_name: HashMap<(u64, String), u64>,
}

/// The libraries and kernels of a session.
#[derive(Debug, Default)]
pub(crate) struct Libraries {
    inner: Mutex<Inner>,
}

impl Libraries {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a library with its image and, if already loaded, its module in a context.
    pub(crate) fn add(&self, image: &[u8], loaded: Option<(RmHandle, Arc<ModuleInfo>)>) -> u64 {
        let mut g = self.lock();
        g.next_id += 1;
        let id = g.next_id;
        g.libraries.insert(
            id,
            Library {
                image: image.into(),
                modules: loaded.into_iter().collect(),
            },
        );
        id
    }

    /// The module of `lib` in `ctx`; `load` loads the image there on first use (without the
    /// lock held). If another thread won the race, `unload` gets the extra module.
    pub(crate) fn module(
        &self,
        lib: u64,
        ctx: RmHandle,
        load: impl FnOnce(&[u8]) -> CuResult<Arc<ModuleInfo>>,
        unload: impl FnOnce(RmHandle),
    ) -> CuResult<Arc<ModuleInfo>> {
        let image = {
            let g = self.lock();
            let l = g.libraries.get(&lib).ok_or(CuError(cu::INVALID_HANDLE))?;
            if let Some(m) = l.modules.get(&ctx) {
                return Ok(Arc::clone(m));
            }
            Arc::clone(&l.image)
        };
        let m = load(&image)?;
        let mut g = self.lock();
        let kept = match g.libraries.get_mut(&lib) {
            Some(l) => match l.modules.get(&ctx) {
                Some(first) => Ok(Arc::clone(first)),
                None => {
                    l.modules.insert(ctx, Arc::clone(&m));
                    return Ok(m);
                }
            },
            None => Err(CuError(cu::INVALID_HANDLE)),
        };
        drop(g);
        unload(m.handle);
        kept
    }

    /// A context in which `lib` is already loaded, if any.
    pub(crate) fn loaded_ctx(&self, lib: u64) -> Option<RmHandle> {
        self.lock()
            .libraries
            .get(&lib)?
            .modules
            .keys()
            .min()
            .copied()
    }

    /// Removes a library and its kernels; returns its modules (to unload).
    pub(crate) fn remove(&self, lib: u64) -> CuResult<Vec<Arc<ModuleInfo>>> {
        let mut g = self.lock();
        let l = g
            .libraries
            .remove(&lib)
            .ok_or(CuError(cu::INVALID_HANDLE))?;
        g.kernels.retain(|_, (owner, _)| *owner != lib);
        g.by_name.retain(|(owner, _), _| *owner != lib);
        Ok(l.modules.into_values().collect())
    }

    /// The kernel id of function `name` of `lib` (the same id each time).
    pub(crate) fn kernel_id(&self, lib: u64, name: &str) -> CuResult<u64> {
        let mut g = self.lock();
        if !g.libraries.contains_key(&lib) {
            return Err(CuError(cu::INVALID_HANDLE));
        }
        let key = (lib, name.to_owned());
        if let Some(id) = g.by_name.get(&key) {
            return Ok(*id);
        }
        g.next_id += 1;
        let id = g.next_id;
        g.kernels.insert(id, key.clone());
        g.by_name.insert(key, id);
        Ok(id)
    }

    /// A kernel's (library id, function name).
    pub(crate) fn kernel(&self, kernel: u64) -> CuResult<(u64, String)> {
        self.lock()
            .kernels
            .get(&kernel)
            .cloned()
            .ok_or(CuError(cu::INVALID_HANDLE))
    }

    /// Forgets the modules loaded in a destroyed context.
    pub(crate) fn forget_ctx(&self, ctx: RmHandle) {
        for l in self.lock().libraries.values_mut() {
            l.modules.remove(&ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::FunctionInfo;
    use std::cell::RefCell;

    fn module(handle: RmHandle, ctx: RmHandle, names: &[&str]) -> Arc<ModuleInfo> {
        let functions = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let f = Arc::new(FunctionInfo {
                    name: (*n).to_owned(),
                    c_name: std::ffi::CString::new(*n).unwrap(),
                    handle: handle * 100 + i as u64,
                    params: Vec::new(),
                    module: handle,
                });
                ((*n).to_owned(), f)
            })
            .collect();
        Arc::new(ModuleInfo {
            handle,
            ctx,
            functions,
        })
    }

    #[test]
    fn a_library_is_a_module_per_context_loaded_once() {
        let libs = Libraries::default();
        let lib = libs.add(b"image", Some((16, module(20, 16, &["vecadd"]))));
        let loads = RefCell::new(Vec::new());
        let load = |ctx: RmHandle, h: RmHandle| {
            let loads = &loads;
            move |img: &[u8]| {
                loads.borrow_mut().push((ctx, img.to_vec()));
                Ok(module(h, ctx, &["vecadd", "other"]))
            }
        };
        // Already loaded in context 16: no new load.
        let m = libs.module(lib, 16, load(16, 99), |_| panic!()).unwrap();
        assert_eq!(m.handle, 20);
        // Context 17 loads the kept image lazily, once.
        let m = libs.module(lib, 17, load(17, 21), |_| panic!()).unwrap();
        assert_eq!(m.handle, 21);
        let m = libs.module(lib, 17, load(17, 22), |_| panic!()).unwrap();
        assert_eq!(m.handle, 21);
        assert_eq!(*loads.borrow(), vec![(17, b"image".to_vec())]);
        // A failed load leaves nothing behind.
        assert_eq!(
            libs.module(lib, 18, |_| Err(CuError(cu::INVALID_IMAGE)), |_| panic!()),
            Err(CuError(cu::INVALID_IMAGE))
        );
        // A destroyed context's module is forgotten and reloaded on next use.
        libs.forget_ctx(17);
        let m = libs.module(lib, 17, load(17, 23), |_| panic!()).unwrap();
        assert_eq!(m.handle, 23);
        assert_eq!(
            libs.module(999, 16, load(16, 1), |_| panic!()),
            Err(CuError(cu::INVALID_HANDLE))
        );
    }

    #[test]
    fn kernels_are_stable_ids_by_name_and_die_with_the_library() {
        let libs = Libraries::default();
        let a = libs.add(b"a", None);
        let b = libs.add(b"b", None);
        let k = libs.kernel_id(a, "vecadd").unwrap();
        assert_eq!(libs.kernel_id(a, "vecadd"), Ok(k));
        let k2 = libs.kernel_id(b, "vecadd").unwrap();
        assert_ne!(k, k2);
        assert_eq!(libs.kernel(k), Ok((a, "vecadd".to_owned())));
        assert_eq!(libs.kernel_id(77, "x"), Err(CuError(cu::INVALID_HANDLE)));
        libs.module(a, 16, |_| Ok(module(30, 16, &["vecadd"])), |_| {})
            .unwrap();
        let removed = libs.remove(a).unwrap();
        assert_eq!(
            removed.iter().map(|m| m.handle).collect::<Vec<_>>(),
            vec![30]
        );
        assert_eq!(libs.kernel(k), Err(CuError(cu::INVALID_HANDLE)));
        assert_eq!(libs.kernel(k2), Ok((b, "vecadd".to_owned())));
        assert!(libs.remove(a).is_err());
    }

    #[test]
    fn a_lost_race_unloads_the_extra_module() {
        let libs = Libraries::default();
        let lib = libs.add(b"img", None);
        let unloaded = RefCell::new(Vec::new());
        let m = libs
            .module(
                lib,
                16,
                |_| {
                    // Another thread loads it while this load runs.
                    libs.module(lib, 16, |_| Ok(module(40, 16, &[])), |_| panic!())
                        .unwrap();
                    Ok(module(41, 16, &[]))
                },
                |h| unloaded.borrow_mut().push(h),
            )
            .unwrap();
        assert_eq!(m.handle, 40);
        assert_eq!(*unloaded.borrow(), vec![41]);
    }
}
