//! [`Session`] methods for modules, functions, globals and libraries.

use sha2::{Digest, Sha256};

use super::*;

impl Session {
    /// Loads a kernel image: over a Unix socket or shared memory to a server of revision 20,
    /// the bytes unnamed (an all-zero hash) in one call, for the server to hash; else its
    /// SHA-256 first and the bytes only if the server asks (`RM_NEED_IMAGE`), which saves
    /// sending an image the server has cached where moving it costs more than hashing it. The
    /// function list and parameter layouts are cached. The image goes from the program's
    /// memory to the connection as it is, never copied first (written after the call's encoded
    /// head, as the bulk copies' chunks are).
    pub fn module_load(&self, ctx: RmHandle, image: &[u8]) -> CuResult<Arc<ModuleInfo>> {
        if image.is_empty() || image.len() > RM_MAX_IMAGE as usize {
            return Err(CuError(cu::INVALID_IMAGE));
        }
        let reply = if self.unnamed_images {
            self.rm_module_load_from(ctx, [0; 32], image)?
        } else {
            let hash = Sha256::digest(image).into();
            match self.rm_module_load_from(ctx, hash, &[])? {
                RmLoadReply::RmNeedImage => self.rm_module_load_from(ctx, hash, image)?,
                r => r,
            }
        };
        let m = match reply {
            RmLoadReply::RmLoaded(m) => m,
            RmLoadReply::RmLoadFailed(e) => return Err(CuError(nonzero(e))),
            RmLoadReply::RmNeedImage => {
                tracing::error!("remora: the server asked for the image again after receiving it");
                return Err(CuError(cu::UNKNOWN));
            }
        };
        let mut functions = HashMap::new();
        {
            let mut by_handle = lock(&self.functions);
            for f in m.functions {
                let info = Arc::new(FunctionInfo {
                    c_name: std::ffi::CString::new(f.name.replace('\0', "")).unwrap_or_default(),
                    name: f.name.clone(),
                    handle: f.function,
                    params: f.params,
                    module: m.module,
                });
                by_handle.insert(f.function, Arc::clone(&info));
                functions.insert(f.name, info);
            }
        }
        let info = Arc::new(ModuleInfo {
            handle: m.module,
            ctx,
            functions,
        });
        lock(&self.modules).insert(m.module, Arc::clone(&info));
        Ok(info)
    }

    /// `RM_MODULE_LOAD` of `image` (empty: by `hash` alone), the image written from the
    /// caller's memory after the encoded head (`ctx`, `hash`, the image's length) and before
    /// its XDR padding, as the bulk copies are: the same record as
    /// [`RmModuleLoadArgs`]'s encoding, without a copy of an image that can be tens of
    /// megabytes (a library's fat binary).
    fn rm_module_load_from(
        &self,
        ctx: RmHandle,
        hash: [u8; 32],
        image: &[u8],
    ) -> CuResult<RmLoadReply> {
        let len = image.len();
        self.coherent("rm_module_load", || {
            self.rpc
                .rpc()
                .start_call(
                    REMORA_PROG,
                    REMORA_V1,
                    RM_MODULE_LOAD,
                    self.rpc.timeout(),
                    |enc| module_load_head(enc, ctx, &hash, len),
                    &[image, super::socket_copies::pad(len)],
                )
                .and_then(|p| p.finish(<RmLoadReply as remora_xdr::XdrDecode>::decode))
        })
        .map_err(|e| from_rpc("rm_module_load", e))
    }

    /// `cuModuleUnload`; forgets the cached functions.
    pub fn module_unload(&self, module: RmHandle) -> CuResult<()> {
        let r = call!(self.rm_module_unload(&module))?;
        self.take_device_output();
        CuError::check(r)?;
        if let Some(m) = lock(&self.modules).remove(&module) {
            let mut f = lock(&self.functions);
            let mut attrs = lock(&self.func_attrs);
            let mut sets = lock(&self.func_sets);
            for info in m.functions.values() {
                f.remove(&info.handle);
                attrs.retain(|(h, _), _| *h != info.handle);
                sets.retain(|(h, _), _| *h != info.handle);
            }
        }
        Ok(())
    }

    /// A loaded module, from the cache.
    pub fn module(&self, module: RmHandle) -> Option<Arc<ModuleInfo>> {
        lock(&self.modules).get(&module).cloned()
    }

    /// `cuModuleGetFunction`: function `name` of `module`, loaded in the driver as natively
    /// (revision 13: the server lists a module's functions without loading them; the first
    /// time a function is asked for, a one-way `RM_FUNC_LOAD` loads it, before any launch of
    /// it can find the context busy, since loading may wait for the context's work).
    pub fn module_get_function(&self, module: RmHandle, name: &str) -> CuResult<Arc<FunctionInfo>> {
        let m = self.module(module).ok_or(CuError(cu::INVALID_HANDLE))?;
        let info = m
            .functions
            .get(name)
            .cloned()
            .ok_or(CuError(cu::NOT_FOUND))?;
        self.ask_load(info.handle)?;
        Ok(info)
    }

    /// Asks the server once to load `function` (revision 13; before that, modules load
    /// whole).
    pub(super) fn ask_load(&self, function: RmHandle) -> CuResult<()> {
        if self.welcome.revision >= 13 && lock(&self.loads_asked).insert(function) {
            call!(self.rm_func_load(&function))?;
        }
        Ok(())
    }

    /// `cuFuncLoad`: loads `function` now (one-way, once; the server also loads any function
    /// before its first launch, attribute or occupancy query).
    pub fn func_load(&self, function: RmHandle) -> CuResult<()> {
        self.function(function).ok_or(CuError(cu::INVALID_HANDLE))?;
        self.ask_load(function)
    }

    /// `cuFuncIsLoaded`: whether `function` is loaded, or asked to be (the server handles the
    /// one-way load before any later call of this session). Before revision 13 modules load
    /// whole.
    pub fn func_is_loaded(&self, function: RmHandle) -> CuResult<bool> {
        self.function(function).ok_or(CuError(cu::INVALID_HANDLE))?;
        Ok(self.welcome.revision < 13 || lock(&self.loads_asked).contains(&function))
    }

    /// A function of a loaded module, from the cache.
    pub fn function(&self, function: RmHandle) -> Option<Arc<FunctionInfo>> {
        lock(&self.functions).get(&function).cloned()
    }

    /// `cuModuleGetGlobal`: (pointer, size).
    pub fn module_get_global(&self, module: RmHandle, name: &str) -> CuResult<(u64, u64)> {
        match call!(self.rm_module_get_global(&RmGetGlobalArgs {
            module,
            name: name.to_owned()
        }))? {
            RmGlobalReply::RmLoaded(g) => Ok((g.ptr, g.size)),
            RmGlobalReply::Default { value, .. } => Err(CuError(nonzero(value))),
        }
    }

    /// `cuFuncGetAttribute`. The attributes fixed at load time (0..=7) and the two that only
    /// `cuFuncSetAttribute` changes (8, 9) are cached.
    pub fn func_get_attribute(&self, function: RmHandle, attribute: i32) -> CuResult<i32> {
        let cacheable = (0..=9).contains(&attribute);
        if cacheable && let Some(v) = lock(&self.func_attrs).get(&(function, attribute)) {
            return Ok(*v);
        }
        let v = Reply::value(call!(self.rm_func_get_attribute(&RmFuncAttrArgs {
            function,
            attribute,
            value: 0
        }))?)?;
        if cacheable {
            lock(&self.func_attrs).insert((function, attribute), v);
        }
        Ok(v)
    }

    /// `cuFuncSetAttribute`.
    pub fn func_set_attribute(
        &self,
        function: RmHandle,
        attribute: i32,
        value: i32,
    ) -> CuResult<()> {
        // The maximum dynamic shared memory reads back as set, and only this session's sets
        // change it, so setting the value it already has asks nothing (libraries set it
        // before every launch).
        use crate::launch::func_attr::MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC_SHARED;
        if (attribute == MAX_DYNAMIC_SHARED
            && lock(&self.func_attrs).get(&(function, attribute)) == Some(&value))
            || lock(&self.func_sets).get(&(function, attribute)) == Some(&value)
        {
            return Ok(());
        }
        let args = RmFuncAttrArgs {
            function,
            attribute,
            value,
        };
        let r = if self.settable_one_way(function, attribute, value) {
            call!(self.rm_func_set_attribute_async(&args))
        } else {
            tracing::debug!(
                function,
                attribute,
                value,
                "cuFuncSetAttribute asks the server"
            );
            CuError::check(call!(self.rm_func_set_attribute(&args))?)
        };
        let mut sets = lock(&self.func_sets);
        if r.is_ok() {
            sets.insert((function, attribute), value);
        } else {
            sets.remove(&(function, attribute));
        }
        drop(sets);
        // Forget the cached value (the next get asks the server), but for a successful set of
        // the maximum dynamic shared memory, whose value is now known.
        let mut attrs = lock(&self.func_attrs);
        attrs.remove(&(function, attribute));
        if r.is_ok() && attribute == MAX_DYNAMIC_SHARED {
            attrs.insert((function, attribute), value);
        }
        drop(attrs);
        lock(&self.launch_limits).retain(|(f, _), _| *f != function);
        r
    }

    /// Whether setting `attribute` of `function` to `value` cannot fail, so that it may go
    /// one-way (revision 13): the maximum dynamic shared memory (8), from 0 up to the device's
    /// opt-in shared memory per block (device attribute 97) less the function's static shared
    /// memory (function attribute 1), both known from the server. The occupancy answers stay:
    /// they are kept by this value (see `occupancy_max_active_blocks`).
    fn settable_one_way(&self, function: RmHandle, attribute: i32, value: i32) -> bool {
        use crate::launch::func_attr::MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC_SHARED;
        const SHARED_SIZE_BYTES: i32 = 1;
        const MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: i32 = 97;
        if self.welcome.revision < 13 || attribute != MAX_DYNAMIC_SHARED || value < 0 {
            return false;
        }
        let Some(info) = self.function(function) else {
            return false;
        };
        let limit = lock(&self.modules)
            .get(&info.module)
            .map(|m| m.ctx)
            .and_then(|ctx| self.ctx_device(ctx).ok())
            .and_then(|dev| {
                self.device_attribute(dev, MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
                    .ok()
            });
        let fixed = self.func_get_attribute(function, SHARED_SIZE_BYTES).ok();
        matches!((limit, fixed), (Some(l), Some(s)) if s >= 0 && value <= l - s)
    }

    /// `cuFuncSetCacheConfig`.
    pub fn func_set_cache_config(&self, function: RmHandle, config: u32) -> CuResult<()> {
        // The cache configuration moves the shared-memory carveout (attribute 9).
        lock(&self.func_sets).retain(|(h, _), _| *h != function);
        lock(&self.func_attrs).remove(&(function, 9));
        CuError::check(call!(self.rm_func_set_cache_config(&RmHandleFlags {
            handle: function,
            flags: config
        }))?)
    }

    // Libraries ----------------------------------------------------------------------------

    /// `cuLibraryLoadData`: keeps a copy of the image; loads it at once in `ctx` if given
    /// (so a bad image fails here), else in each context on first use. Returns the library id.
    pub fn library_load(&self, ctx: Option<RmHandle>, image: &[u8]) -> CuResult<u64> {
        if image.is_empty() || image.len() > RM_MAX_IMAGE as usize {
            return Err(CuError(cu::INVALID_IMAGE));
        }
        let loaded = match ctx {
            Some(ctx) => Some((ctx, self.module_load(ctx, image)?)),
            None => None,
        };
        Ok(self.libraries.add(image, loaded))
    }

    /// The module of library `lib` in context `ctx` (`cuLibraryGetModule`), loaded on first use.
    pub fn library_module(&self, lib: u64, ctx: RmHandle) -> CuResult<Arc<ModuleInfo>> {
        self.libraries.module(
            lib,
            ctx,
            |image| self.module_load(ctx, image),
            |extra| {
                let _ = self.module_unload(extra);
            },
        )
    }

    /// `cuLibraryUnload`: unloads its modules and forgets its kernels.
    pub fn library_unload(&self, lib: u64) -> CuResult<()> {
        let mut result = Ok(());
        for m in self.libraries.remove(lib)? {
            if let Err(e) = self.module_unload(m.handle) {
                result = result.and(Err(e));
            }
        }
        result
    }

    /// The context whose module of `lib` answers context-independent questions (its kernels'
    /// names): `ctx`, the calling thread's current context, when there is one. Natively
    /// `cuLibraryGetKernel` needs no context (the CUDA runtime calls it from threads that have
    /// none, e.g. PyTorch's autograd threads); then a context where the library is already
    /// loaded, else any context of this session (the names are the same in all), else
    /// CUDA_ERROR_INVALID_CONTEXT.
    fn library_ctx(&self, lib: u64, ctx: Option<RmHandle>) -> CuResult<RmHandle> {
        if let Some(c) = ctx {
            return Ok(c);
        }
        self.libraries
            .loaded_ctx(lib)
            .or_else(|| lock(&self.ctx_devices).keys().min().copied())
            .ok_or(CuError(cu::INVALID_CONTEXT))
    }

    /// The kernel names of library `lib` (sorted), from its module in `ctx` (see
    /// `library_ctx` for `None`).
    pub fn library_kernel_names(&self, lib: u64, ctx: Option<RmHandle>) -> CuResult<Vec<String>> {
        let m = self.library_module(lib, self.library_ctx(lib, ctx)?)?;
        let mut names: Vec<String> = m.functions.keys().cloned().collect();
        names.sort();
        Ok(names)
    }

    /// `cuLibraryGetKernel`: the kernel id of `name` (the same id for the same name); `ctx`
    /// is the calling thread's current context, if any (see `library_ctx`).
    pub fn library_get_kernel(&self, lib: u64, name: &str, ctx: Option<RmHandle>) -> CuResult<u64> {
        let m = self.library_module(lib, self.library_ctx(lib, ctx)?)?;
        if !m.functions.contains_key(name) {
            return Err(CuError(cu::NOT_FOUND));
        }
        self.libraries.kernel_id(lib, name)
    }

    /// A kernel's (library id, function name).
    pub fn kernel(&self, kernel: u64) -> CuResult<(u64, String)> {
        self.libraries.kernel(kernel)
    }

    /// `cuKernelGetFunction`: the kernel's function in context `ctx` (loading the library's
    /// module there if needed).
    pub fn kernel_function(&self, kernel: u64, ctx: RmHandle) -> CuResult<Arc<FunctionInfo>> {
        let (lib, name) = self.kernel(kernel)?;
        let m = self.library_module(lib, ctx)?;
        m.functions
            .get(&name)
            .cloned()
            .ok_or(CuError(cu::NOT_FOUND))
    }

    /// `cuLibraryGetGlobal`: (pointer, size) of `name` in the library's module in `ctx`.
    pub fn library_get_global(&self, lib: u64, name: &str, ctx: RmHandle) -> CuResult<(u64, u64)> {
        let m = self.library_module(lib, ctx)?;
        self.module_get_global(m.handle, name)
    }
}

/// `rm_module_load_args` up to the image's bytes: `ctx`, `hash` and the image's length. The
/// bytes and their padding follow as raw slices ([`Session::rm_module_load_from`]).
fn module_load_head(
    enc: &mut remora_xdr::Encoder,
    ctx: RmHandle,
    hash: &[u8; 32],
    len: usize,
) -> remora_xdr::Result<()> {
    enc.put_u64(ctx);
    enc.put_fixed_opaque(hash);
    enc.put_len(len, RM_MAX_IMAGE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use remora_xdr::XdrEncode as _;

    #[test]
    fn the_head_and_raw_image_encode_as_rm_module_load_args() {
        for len in [0usize, 1, 2, 3, 4, 5, 4097, 70_000] {
            let image: Vec<u8> = (0..len).map(|i| (i * 7) as u8 ^ 0x3c).collect();
            let hash = [0xabu8; 32];
            let mut want = remora_xdr::Encoder::new();
            RmModuleLoadArgs {
                ctx: 11,
                hash,
                image: Bytes::copy_from_slice(&image),
            }
            .encode(&mut want)
            .unwrap();
            let mut got = remora_xdr::Encoder::new();
            module_load_head(&mut got, 11, &hash, len).unwrap();
            let mut got = got.to_bytes().to_vec();
            got.extend_from_slice(&image);
            got.extend_from_slice(super::super::socket_copies::pad(len));
            assert_eq!(got, want.to_bytes().to_vec(), "len {len}");
        }
        // An image past the bound is refused by the head, as by the generated encoder.
        let mut enc = remora_xdr::Encoder::new();
        assert!(module_load_head(&mut enc, 1, &[0; 32], RM_MAX_IMAGE as usize + 1).is_err());
    }
}
