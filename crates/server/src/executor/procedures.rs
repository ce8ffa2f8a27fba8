//! `impl RemoraV1Server for Executor`: every procedure of `remora.x`. The short ones are
//! answered here; the longer ones call the `Executor` methods of the concern modules.

use super::capture::graph_exec_target;
use super::copies::{dtod_copy, memset_2d_target, memset_target, peer_target};
use super::*;
use remora_proto::cuda::{CuError, cu};
use remora_proto::pool_access;

/// Trait methods that call the `Executor` method of the same arguments.
macro_rules! forward {
    ($($proc:ident($arg:ty) -> $ret:ty => $method:ident;)*) => {
        $(fn $proc(&self, call: &CallContext, a: $arg) -> ProcResult<$ret> {
            self.$method(call, a)
        })*
    };
}

/// Trait methods answered by the `Executor` method that takes the call's session and the
/// arguments and returns the reply (a procedure that neither defers its reply nor closes the
/// connection). A row may name further arguments of the method: `=> method(true);`.
macro_rules! answer {
    ($($proc:ident($arg:ty) -> $ret:ty => $method:ident $(($($flag:expr),*))?;)*) => {
        $(fn $proc(&self, call: &CallContext, a: $arg) -> ProcResult<$ret> {
            Ok(self.$method(&self.session(call), a $($(, $flag)*)?))
        })*
    };
}

/// Trait methods answered by the `Executor` method that works on the call's session state,
/// locked for the whole call, and returns a `CuResult`: the reply is made of it, a failure
/// logged as the row's procedure name.
macro_rules! locked {
    ($($proc:ident($arg:ty) -> $ret:ty => $method:ident, $what:literal;)*) => {
        $(fn $proc(&self, call: &CallContext, a: $arg) -> ProcResult<$ret> {
            let session = self.session(call);
            let r = self.$method(&mut session.lock(), a);
            Ok(<$ret>::from_result($what, r))
        })*
    };
}

/// Trait methods whose body is one call of an `Executor` method that resolves the call's
/// session handles (under the session lock) and runs a closure on the backend with the raw
/// objects (without it). A row names its argument and the procedure:
/// `proc(a: Args) -> Reply, "NAME" => how(x, ..), |b, raw, ..| body;` stands for
/// * in a `reply:` table, `self.how(&self.session(call), x, .., |b, raw, ..| body)`
///   (`resolved`, `in_ctx`, `in_function`, `occupancy`, ..): the reply is made of its
///   `CuResult`, a failure logged as "NAME";
/// * in a `call:` table, `self.how(call, "NAME", x, .., |b, raw, ..| body)`, a method that
///   answers itself, later or not at all, and logs or defers a failure as "NAME":
///   `sync_call` (answers with the delivered copies) or `oneway_on_stream` (a one-way call on
///   the stream `(ctx, stream)`).
macro_rules! resolving {
    (@body reply, $self:ident, $call:ident, $what:literal, $how:ident, ($($x:expr),*), $f:expr) => {
        Ok(FromResult::from_result($what, $self.$how(&$self.session($call), $($x,)* $f)))
    };
    (@body call, $self:ident, $call:ident, $what:literal, $how:ident, ($($x:expr),*), $f:expr) => {
        $self.$how($call, $what, $($x,)* $f)
    };
    ($mode:ident: $($proc:ident($a:ident: $arg:ty) -> $ret:ty, $what:literal
        => $how:ident($($x:expr),*), |$($p:pat_param),*| $run:expr;)*) => {
        $(fn $proc(&self, call: &CallContext, $a: $arg) -> ProcResult<$ret> {
            resolving!(@body $mode, self, call, $what, $how, ($($x),*), |$($p),*| $run)
        })*
    };
}

impl RemoraV1Server for Executor {
    // The plain calls, generated from their `@glue` annotations in remora.x.
    remora_proto::executor_glue!();

    // Procedures answered by an `Executor` method of a concern module.
    forward! {
        rm_device_get_props(i32) -> RmDevicePropsReply => device_get_props;
        rm_primary_ctx_set_flags(RmPrimaryFlagsArgs) -> CuResult_ => primary_ctx_set_flags;
        rm_primary_ctx_get_state(i32) -> RmPrimaryStateReply => primary_ctx_get_state;
        rm_ctx_synchronize(RmHandle) -> RmSyncReply => ctx_synchronize;
        rm_tools_ctx_query(RmToolsCtxQueryArgs) -> RmU64Reply => tools_ctx_query;
        rm_tools_stream_query(RmToolsStreamQueryArgs) -> RmU64Reply => tools_stream_query;
        rm_memcpy_htod(RmHtodArgs) -> RmSyncReply => memcpy_htod;
        rm_memcpy_dtoh(RmDtohArgs) -> RmDtohReply => memcpy_dtoh;
        rm_memcpy_dtoh_stream(RmDtohArgs) -> RmDtohReply => memcpy_dtoh_stream;
        rm_memcpy_htod_async(RmHtodArgs) -> () => memcpy_htod_async;
        rm_memcpy_dtoh_async(RmDtohArgs) -> () => memcpy_dtoh_async;
        rm_module_load(RmModuleLoadArgs) -> RmLoadReply => module_load;
        rm_launch_kernel(RmLaunchArgs) -> () => launch_kernel;
        rm_stream_synchronize(RmStreamArgs) -> RmSyncReply => stream_synchronize;
        rm_event_record(RmEventRecordArgs) -> () => event_record;
        rm_area_memcpy_htod(RmAreaCopyArgs) -> RmSyncReply => area_memcpy_htod;
        rm_area_memcpy_dtoh(RmAreaCopyArgs) -> RmSyncReply => area_memcpy_dtoh;
        rm_area_memcpy_htod_async(RmAreaCopyArgs) -> () => area_memcpy_htod_async;
        rm_area_memcpy_dtoh_async(RmAreaCopyArgs) -> () => area_memcpy_dtoh_async;
        rm_mem_host_device_pointer(RmAreaPtrArgs) -> RmU64Reply => mem_host_device_pointer;
        rm_area_map(RmAreaMapArgs) -> RmU64Reply => area_map;
    }

    answer! {
        rm_primary_ctx_retain(i32) -> RmHandleReply => primary_ctx_retain;
        rm_primary_ctx_reset(i32) -> CuResult_ => primary_ctx_reset;
        rm_ctx_create(RmCtxCreateArgs) -> RmHandleReply => ctx_create;
        rm_ctx_destroy(RmHandle) -> CuResult_ => ctx_destroy;
        rm_mem_alloc(RmAllocArgs) -> RmU64Reply => mem_alloc;
        rm_mem_alloc_pitch(RmAllocPitchArgs) -> RmPitchedReply => mem_alloc_pitch;
        rm_mem_free(RmPtrArgs) -> CuResult_ => mem_free;
        rm_mem_get_info(RmHandle) -> RmMemInfoReply => mem_get_info;
        rm_mem_get_address_range(RmPtrArgs) -> RmRangeReply => mem_get_address_range;
        rm_module_unload(RmHandle) -> CuResult_ => module_unload;
        rm_module_get_global(RmGetGlobalArgs) -> RmGlobalReply => module_get_global;
        rm_occupancy_max_active_clusters(RmLaunchArgs) -> RmIntReply => occupancy_max_active_clusters;
        rm_stream_create(RmStreamCreateArgs) -> RmHandleReply => stream_create;
        rm_event_elapsed_time(RmElapsedArgs) -> RmFloatReply => event_elapsed_time;
        rm_stream_end_capture(RmStreamArgs) -> RmEndCaptureReply => stream_end_capture;
        rm_stream_get_capture_info(RmStreamArgs) -> RmCaptureInfoReply => stream_get_capture_info;
        rm_graph_destroy(RmHandle) -> CuResult_ => graph_destroy;
        rm_mem_create(RmMemCreateArgs) -> RmHandleReply => mem_create;
        rm_mem_address_reserve(RmMemReserveArgs) -> RmU64Reply => mem_address_reserve;
        rm_mem_address_free(RmMemRangeArgs) -> CuResult_ => mem_address_free;
        rm_mem_set_access(RmMemSetAccessArgs) -> CuResult_ => mem_set_access;
        rm_mem_get_access(RmMemGetAccessArgs) -> RmU64Reply => mem_get_access;
        rm_mem_get_granularity(RmMemGranularityArgs) -> RmU64Reply => mem_get_granularity;
    }

    locked! {
        rm_stream_begin_capture(RmBeginCaptureArgs) -> RmCaptureBegunReply => stream_begin_capture, "RM_STREAM_BEGIN_CAPTURE";
        rm_graph_instantiate(RmGraphInstantiateArgs) -> RmHandleReply => graph_instantiate, "RM_GRAPH_INSTANTIATE";
        rm_mem_release(RmMemHandleArgs) -> CuResult_ => mem_release, "RM_MEM_RELEASE";
        rm_mem_map(RmMemMapArgs) -> CuResult_ => mem_map, "RM_MEM_MAP";
        rm_mem_unmap(RmMemRangeArgs) -> CuResult_ => mem_unmap, "RM_MEM_UNMAP";
        rm_mem_get_properties(RmMemHandleArgs) -> RmMemPropReply => mem_get_properties, "RM_MEM_GET_PROPERTIES";
        rm_mem_retain_handle(RmPtrArgs) -> RmHandleReply => mem_retain_handle, "RM_MEM_RETAIN_HANDLE";
    }

    resolving! { reply:
        rm_ctx_get_stream_priority_range(h: RmHandle) -> RmIntPairReply, "RM_CTX_GET_STREAM_PRIORITY_RANGE"
            => in_ctx(h), |b, c| b.ctx_stream_priority_range(c);
        rm_stream_set_attribute(a: RmStreamAttrArgs) -> CuResult_, "RM_STREAM_SET_ATTRIBUTE"
            => resolved(|st| {
                // An access policy window names device memory: it must be the session's.
                if let RmStreamAttr::Case1(w) = &a.value
                    && w.num_bytes > 0
                {
                    st.range_of(w.base).map_err(|_| CuError(cu::INVALID_VALUE))?;
                }
                stream_target(st, a.ctx, a.stream)
            }), |b, t| b.stream_set_attribute(t.ctx, t.stream, &a.value);
        rm_stream_get_attribute(a: RmStreamAttrQuery) -> RmStreamAttrReply, "RM_STREAM_GET_ATTRIBUTE"
            => resolved(|st| stream_target(st, a.ctx, a.stream)),
            |b, t| b.stream_get_attribute(t.ctx, t.stream, a.kind);
        rm_func_get_attribute(a: RmFuncAttrArgs) -> RmIntReply, "RM_FUNC_GET_ATTRIBUTE"
            => in_function(a.function), |b, f, c| b.func_get_attribute(c, f, a.attribute);
        rm_func_set_attribute(a: RmFuncAttrArgs) -> CuResult_, "RM_FUNC_SET_ATTRIBUTE"
            => in_function(a.function), |b, f, c| b.func_set_attribute(c, f, a.attribute, a.value);
        rm_func_set_cache_config(a: RmHandleFlags) -> CuResult_, "RM_FUNC_SET_CACHE_CONFIG"
            => in_function(a.handle), |b, f, c| b.func_set_cache_config(c, f, a.flags);
        rm_occupancy_max_active_blocks(a: RmOccupancyArgs) -> RmIntReply, "RM_OCCUPANCY_MAX_ACTIVE_BLOCKS"
            => occupancy(a.function, (a.block_size, a.dynamic_smem_bytes, a.flags)),
            |b, c, q| b.occupancy_max_active_blocks(c, q);
        rm_occupancy_max_potential_block_size(a: RmPotentialBlockArgs) -> RmIntPairReply, "RM_OCCUPANCY_MAX_POTENTIAL_BLOCK_SIZE"
            => occupancy(a.function, (a.block_size_limit, a.dynamic_smem_bytes, a.flags)),
            |b, c, q| b.occupancy_max_potential_block_size(c, q);
    }

    // Copies, memsets, stream and event calls that answer with the delivered copies
    // (`sync_call`) or are one-way (`oneway_on_stream`).
    resolving! { call:
        rm_memcpy_dtod(a: RmDtodArgs) -> RmSyncReply, "RM_MEMCPY_DTOD"
            => sync_call(|st| {
                st.check_range(a.dst, a.size)?;
                st.check_range(a.src, a.size)?;
                st.ctx(a.ctx)
            }),
            |b, c| b.memcpy_dtod(c, None, dtod_copy(&a));
        rm_memcpy_dtod_async(a: RmDtodArgs) -> (), "RM_MEMCPY_DTOD_ASYNC"
            => oneway_on_stream((a.ctx, a.stream), |st| {
                st.check_range(a.dst, a.size)?;
                st.check_range(a.src, a.size)?;
                Ok((st.ctx(a.ctx)?, st.stream(a.stream)?))
            }),
            |b, (c, s)| b.memcpy_dtod(c, Some(s), dtod_copy(&a));
        rm_memset(a: RmMemsetArgs) -> RmSyncReply, "RM_MEMSET"
            => sync_call(|st| memset_target(st, &a)),
            |b, (c, _)| {
                let m = Memset::linear(a.dst, a.value, a.element_size, a.count);
                b.memset(c, None, &m)
            };
        rm_memset_async(a: RmMemsetArgs) -> (), "RM_MEMSET_ASYNC"
            => oneway_on_stream((a.ctx, a.stream), |st| memset_target(st, &a)),
            |b, (c, s)| {
                let m = Memset::linear(a.dst, a.value, a.element_size, a.count);
                b.memset(c, Some(s), &m)
            };
        rm_memset_rows(a: RmMemset2dArgs) -> RmSyncReply, "RM_MEMSET_ROWS"
            => sync_call(|st| memset_2d_target(st, &a)),
            |b, ((c, _), m)| b.memset(c, None, &m);
        rm_memset_rows_async(a: RmMemset2dArgs) -> (), "RM_MEMSET_ROWS_ASYNC"
            => oneway_on_stream((a.ctx, a.stream), |st| memset_2d_target(st, &a)),
            |b, ((c, s), m)| b.memset(c, Some(s), &m);
        rm_memcpy_peer(a: RmMemcpyPeerArgs) -> RmSyncReply, "RM_MEMCPY_PEER"
            => sync_call(|st| peer_target(st, &a)),
            |b, (c, _, copy)| b.memcpy_peer(c, None, copy);
        rm_memcpy_peer_async(a: RmMemcpyPeerArgs) -> (), "RM_MEMCPY_PEER_ASYNC"
            => oneway_on_stream((a.ctx, a.stream), |st| peer_target(st, &a)),
            |b, (c, s, copy)| b.memcpy_peer(c, Some(s), copy);
        rm_stream_query(a: RmStreamArgs) -> RmSyncReply, "RM_STREAM_QUERY"
            => sync_call(|st| stream_target(st, a.ctx, a.stream)),
            |b, t| b.stream_query(t.ctx, t.stream);
        rm_stream_wait_event(a: RmStreamWaitArgs) -> (), "RM_STREAM_WAIT_EVENT"
            => oneway_on_stream(
                (a.ctx, a.stream),
                |st| Ok((stream_target(st, a.ctx, a.stream)?, st.event(a.event)?))
            ),
            |b, (t, (e, _))| b.stream_wait_event(t.ctx, t.stream, e, a.flags);
        rm_event_query(h: RmHandle) -> RmSyncReply, "RM_EVENT_QUERY"
            => sync_call(|st| st.event(h)),
            |b, (e, c)| b.event_query(c, e);
        rm_graph_upload(a: RmGraphLaunchArgs) -> (), "RM_GRAPH_UPLOAD"
            => oneway_on_stream((a.ctx, a.stream), |st| graph_exec_target(st, &a)),
            |b, (exec, t)| b.graph_upload(t.ctx, exec, t.stream);
    }

    // Stream-ordered allocation and memory pools (revision 10): `executor/pools.rs`.
    forward! {
        rm_mem_pool_create(RmPoolProps) -> RmHandleReply => mem_pool_create;
    }

    answer! {
        rm_mem_alloc_async(RmAllocAsyncArgs) -> RmU64Reply => mem_alloc_async;
        rm_mem_free_async(RmFreeAsyncArgs) -> CuResult_ => mem_free_async;
        rm_device_get_default_mem_pool(i32) -> RmHandleReply => device_get_default_mem_pool;
        rm_device_get_mem_pool(i32) -> RmHandleReply => device_get_mem_pool;
        rm_mem_pool_destroy(RmHandle) -> CuResult_ => mem_pool_destroy;
    }

    resolving! { reply:
        rm_device_set_mem_pool(a: RmDevicePoolArgs) -> CuResult_, "RM_DEVICE_SET_MEM_POOL"
            => resolved_on_device(a.device, |st| st.mem_pool(a.pool)),
            |b, p| b.device_set_mem_pool(a.device, p);
        rm_mem_pool_set_attribute(a: RmPoolAttrArgs) -> CuResult_, "RM_MEM_POOL_SET_ATTRIBUTE"
            => resolved(|st| st.mem_pool(a.pool)),
            |b, p| b.mem_pool_set_attribute(p, a.attribute, a.value);
        rm_mem_pool_get_attribute(a: RmPoolAttrArgs) -> RmU64Reply, "RM_MEM_POOL_GET_ATTRIBUTE"
            => resolved(|st| st.mem_pool(a.pool)),
            |b, p| b.mem_pool_get_attribute(p, a.attribute);
        rm_mem_pool_trim_to(a: RmPoolTrimArgs) -> CuResult_, "RM_MEM_POOL_TRIM_TO"
            => resolved(|st| st.mem_pool(a.pool)),
            |b, p| b.mem_pool_trim_to(p, a.keep);
        rm_mem_pool_set_access(a: RmPoolSetAccessArgs) -> CuResult_, "RM_MEM_POOL_SET_ACCESS"
            => resolved(|st| st.mem_pool(a.pool)),
            |b, p| {
                let map: Vec<_> = a.map.iter().map(pool_access::access_to_abi).collect();
                b.mem_pool_set_access(p, &map)
            };
        rm_mem_pool_get_access(a: RmPoolGetAccessArgs) -> RmIntReply, "RM_MEM_POOL_GET_ACCESS"
            => resolved(|st| st.mem_pool(a.pool)),
            |b, p| b.mem_pool_get_access(p, pool_access::location_to_abi(&a.location));
    }

    // Explicit CUDA graphs (revision 11): `executor/graphs.rs`.
    forward! {
        rm_graph_add_node(RmAddNodeArgs) -> RmHandleReply => graph_add_node;
        rm_graph_node_get_params(RmHandle) -> RmNodeParamsReply => graph_node_get_params;
    }

    answer! {
        rm_graph_create(RmGraphCreateArgs) -> RmHandleReply => graph_create;
        rm_graph_destroy_node(RmHandle) -> CuResult_ => graph_destroy_node;
        rm_graph_add_dependencies(RmGraphEdgesArgs) -> CuResult_ => edges_change(true);
        rm_graph_remove_dependencies(RmGraphEdgesArgs) -> CuResult_ => edges_change(false);
        rm_graph_get_nodes(RmHandle) -> RmNodeListReply => graph_node_list(false, "RM_GRAPH_GET_NODES");
        rm_graph_get_root_nodes(RmHandle) -> RmNodeListReply => graph_node_list(true, "RM_GRAPH_GET_ROOT_NODES");
        rm_graph_node_get_type(RmHandle) -> RmIntReply => graph_node_get_type;
        rm_graph_node_get_dependencies(RmHandle) -> RmNodeListReply => node_links(false, "RM_GRAPH_NODE_GET_DEPENDENCIES");
        rm_graph_node_get_dependent_nodes(RmHandle) -> RmNodeListReply => node_links(true, "RM_GRAPH_NODE_GET_DEPENDENT_NODES");
        rm_graph_exec_update(RmExecUpdateArgs) -> RmExecUpdateReply => graph_exec_update;
    }

    locked! {
        rm_graph_get_edges(RmHandle) -> RmGraphEdgesReply => graph_get_edges, "RM_GRAPH_GET_EDGES";
        rm_graph_clone(RmHandle) -> RmHandleReply => graph_clone, "RM_GRAPH_CLONE";
        rm_graph_add_mem_alloc_node(RmAddNodeArgs) -> RmMemAllocNodeReply => graph_add_mem_alloc_node, "RM_GRAPH_ADD_MEM_ALLOC_NODE";
    }

    fn remora_null(&self, _call: &CallContext) -> ProcResult<()> {
        Ok(())
    }

    fn remora_lane_key(&self, call: &CallContext) -> ProcResult<LaneKeyReply> {
        Ok(self.lane_key(call))
    }

    fn remora_lane_attach(&self, call: &CallContext, key: LaneKey) -> ProcResult<CuResult_> {
        self.lane_attach(call, key)
    }

    fn remora_status(&self, call: &CallContext) -> ProcResult<StatusReply> {
        use crate::quota::Kind;
        let report = self.quotas_report();
        let own = call.tenant();
        let sessions = report
            .values()
            .map(|r| r.used[Kind::Sessions.index()])
            .sum();
        let tenants = report
            .into_iter()
            .filter(|(name, _)| own.is_none_or(|t| t == name))
            .take(REMORA_MAX_STATUS_TENANTS as usize)
            .map(|(name, r)| {
                let u = |k: Kind| r.used[k.index()];
                StatusTenant {
                    name: crate::hello::truncate(name, REMORA_MAX_NAME),
                    sessions: u(Kind::Sessions),
                    device_memory: u(Kind::DeviceMemory),
                    pinned_memory: u(Kind::PinnedMemory),
                    in_flight: u(Kind::InFlight),
                    streams: u(Kind::Streams),
                    events: u(Kind::Events),
                    modules: u(Kind::Modules),
                    refusals: r.hits.iter().sum(),
                }
            })
            .collect();
        Ok(StatusReply {
            sessions,
            all_tenants: own.is_none(),
            tenants,
        })
    }

    fn remora_hello_auth(&self, call: &CallContext, args: HelloAuthArgs) -> ProcResult<HelloReply> {
        // Never log `args` as a whole: it holds the token.
        let Some(tokens) = self.inner.hello.tokens() else {
            // A server without tokens answers as it answers HELLO; the token means nothing.
            return self.remora_hello(call, args.hello);
        };
        let tenant = tokens.tenant_of(&args.token);
        let refused = match (tenant, call.tenant()) {
            (None, _) => Some("a token the server does not know"),
            (Some(t), Some(already)) if t != already => {
                Some("a token of another tenant than the connection authenticated as")
            }
            (Some(t), _) => {
                call.authenticate(t);
                remora_oncrpc::audit!(info, "auth_ok", peer = %call.peer,
                    connection = call.connection,
                    tenant = t,
                    client = %args.hello.client_name,
                    "authenticated"
                );
                None
            }
        };
        if let Some(what) = refused {
            remora_oncrpc::audit!(warn, "auth_failed", peer = %call.peer,
                connection = call.connection,
                client = %args.hello.client_name,
                "authentication failed: HELLO_AUTH with {what}; AUTH_ERROR (AUTH_BADCRED), connection closed"
            );
            return Err(ProcError::Denied(remora_oncrpc::AuthStat::BadCred));
        }
        self.remora_hello(call, args.hello)
    }

    fn remora_hello(&self, call: &CallContext, args: HelloArgs) -> ProcResult<HelloReply> {
        tracing::info!(client = %args.client_name, peer = %call.peer, connection = call.connection, tenant = call.tenant().unwrap_or("-"), "HELLO");
        if args.capabilities & u64::from(REMORA_CAP_NO_SESSION) != 0 {
            // remora status / info: no session, nothing counted.
            return Ok(self.inner.hello.answer(&args));
        }
        if let Some(why) = self.inner.refusal.get() {
            return Ok(crate::hello::refusal(format!("session refused: {why}")));
        }
        let session = self.session(call);
        if let Some(Err(why)) = session.quota.get() {
            return Ok(crate::hello::refusal(format!(
                "session refused: {why}; end another session of this tenant or ask the operator \
                 to raise the limit (remora serve --tenants / --limit tenant.sessions=N)"
            )));
        }
        let reply = self.inner.hello.answer(&args);
        if let HelloReply::True(w) = &reply {
            if let Some(out) = self.inner.device_output.get() {
                out.set_deliver(w.revision >= DELIVERY_REVISION);
            }
            session
                .loads_functions
                .store(w.revision >= FUNC_LOAD_REVISION, Ordering::Relaxed);
        }
        Ok(reply)
    }

    // Devices --------------------------------------------------------------------------------

    fn rm_device_get_count(&self, _call: &CallContext) -> ProcResult<RmIntReply> {
        Ok(int_reply(
            "RM_DEVICE_GET_COUNT",
            self.inner.backend.device_count(),
        ))
    }

    fn rm_device_get_attribute(
        &self,
        _call: &CallContext,
        a: RmDeviceAttrArgs,
    ) -> ProcResult<RmIntReply> {
        Ok(int_reply(
            "RM_DEVICE_GET_ATTRIBUTE",
            self.inner.backend.device_attribute(a.attribute, a.device),
        ))
    }

    // Contexts -------------------------------------------------------------------------------

    fn rm_primary_ctx_release(&self, call: &CallContext, dev: i32) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        Ok(code(
            "RM_PRIMARY_CTX_RELEASE",
            self.inner.release_primary(&mut st, dev, false),
        ))
    }

    // Memory ---------------------------------------------------------------------------------

    // Modules and functions -----------------------------------------------------------------

    // Launches -------------------------------------------------------------------------------

    // Streams and events ----------------------------------------------------------------------

    fn rm_stream_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        Ok(self.destroy_in_ctx(
            &self.session(call),
            h,
            "RM_STREAM_DESTROY",
            |r| match r {
                Resource::Stream { raw, ctx } => Ok((*raw, *ctx)),
                _ => Err(CuError(cu::INVALID_HANDLE)),
            },
            |b, c, raw| b.stream_destroy(c, raw),
        ))
    }

    fn rm_event_create(&self, call: &CallContext, a: RmHandleFlags) -> ProcResult<RmHandleReply> {
        Ok(self.create_in_ctx(
            &self.session(call),
            "RM_EVENT_CREATE",
            a.handle,
            crate::quota::Kind::Events,
            |b, c| b.event_create(c, a.flags),
            |raw| Resource::Event { raw, ctx: a.handle },
        ))
    }

    fn rm_event_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        let r = st
            .event(h)
            .and_then(|(e, c)| self.inner.backend.event_destroy(c, e));
        if r.is_ok() || st.event(h).is_ok() {
            st.remove(h);
        }
        Ok(code("RM_EVENT_DESTROY", r))
    }

    fn rm_event_create_many(
        &self,
        call: &CallContext,
        a: RmEventBatchArgs,
    ) -> ProcResult<RmHandlesReply> {
        Ok(reply!(
            "RM_EVENT_CREATE_MANY",
            RmHandlesReply,
            self.event_create_many(&self.session(call), a)
        ))
    }

    fn rm_ctx_synchronize_read(
        &self,
        call: &CallContext,
        a: RmCtxSyncReadArgs,
    ) -> ProcResult<RmSyncReply> {
        self.ctx_synchronize_read(call, a)
    }

    fn rm_func_set_attribute_async(&self, call: &CallContext, a: RmFuncAttrArgs) -> ProcResult<()> {
        self.oneway_on(
            call,
            "RM_FUNC_SET_ATTRIBUTE_ASYNC",
            None,
            |inner, session| {
                let t = session.lock().function(a.function)?;
                t.ensure_loaded(&*inner.backend)?;
                inner
                    .backend
                    .func_set_attribute(t.ctx, t.raw, a.attribute, a.value)
            },
        )
    }

    fn rm_stream_signal(&self, call: &CallContext, a: RmStreamSignalArgs) -> ProcResult<()> {
        self.stream_signal(call, a)
    }

    fn rm_func_load(&self, call: &CallContext, h: RmHandle) -> ProcResult<()> {
        self.oneway_on(call, "RM_FUNC_LOAD", None, |inner, session| {
            let t = session.lock().function(h)?;
            t.ensure_loaded(&*inner.backend)
        })
    }

    fn rm_mem_free_async_oneway(&self, call: &CallContext, a: RmFreeAsyncArgs) -> ProcResult<()> {
        self.mem_free_async_oneway(call, a)
    }

    fn rm_event_destroy_async(&self, call: &CallContext, h: RmHandle) -> ProcResult<()> {
        self.oneway_on(call, "RM_EVENT_DESTROY_ASYNC", None, |inner, session| {
            let mut st = session.lock();
            let (e, c) = st.event(h)?;
            let r = inner.backend.event_destroy(c, e);
            st.remove(h);
            r
        })
    }

    fn rm_event_synchronize(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmSyncReply> {
        self.synchronizing(
            call,
            |st| st.event(h),
            |b, &(e, c)| b.event_query(c, e),
            move |inner, session| {
                let ev = session.lock().event(h);
                let own = ev.and_then(|(e, c)| inner.backend.event_synchronize(c, e));
                let mut st = session.lock();
                inner.sync_reply("RM_EVENT_SYNCHRONIZE", &mut st, own, Scope::Finished)
            },
        )
    }

    // 2-D, 3-D and peer copies ------------------------------------------------------------

    fn rm_memcpy_3_d(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<RmDtohReply> {
        self.copy_3d(call, a, false)
    }

    fn rm_memcpy_3_d_async(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<()> {
        self.copy_3d_async(call, a, false)
    }

    fn rm_memcpy_3_d_peer(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<RmDtohReply> {
        self.copy_3d(call, a, true)
    }

    fn rm_memcpy_3_d_peer_async(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<()> {
        self.copy_3d_async(call, a, true)
    }

    // Device-side printf output -------------------------------------------------------------

    fn rm_device_output_take(&self, _call: &CallContext) -> ProcResult<RmBytes> {
        Ok(self.inner.take_device_output().unwrap_or_default())
    }

    // Host callbacks (see crate::host_callbacks) ---------------------------------------------

    /// One-way: enqueues on the stream a host function that reports callback `callback_id`
    /// due when the stream reaches it and blocks the stream until the client reports it done.
    /// From here on the session's calls run on its ordered thread.
    fn rm_launch_host_func(&self, call: &CallContext, a: RmHostFuncArgs) -> ProcResult<()> {
        self.launch_host_func(call, "RM_LAUNCH_HOST_FUNC", a, Vec::new())
    }

    fn rm_launch_host_func_copies(
        &self,
        call: &CallContext,
        a: RmHostFuncCopiesArgs,
    ) -> ProcResult<()> {
        let args = RmHostFuncArgs {
            ctx: a.ctx,
            stream: a.stream,
            callback_id: a.callback_id,
        };
        self.launch_host_func(call, "RM_LAUNCH_HOST_FUNC_COPIES", args, a.copies)
    }

    fn rm_wait_host_callbacks(&self, call: &CallContext) -> ProcResult<RmHostCallbacksReply> {
        self.wait_host_callbacks(call)
    }

    fn rm_host_callback_done(&self, call: &CallContext, id: u64) -> ProcResult<CuResult_> {
        let session = self.session(call);
        Ok(code("RM_HOST_CALLBACK_DONE", session.callbacks.done(id)))
    }

    /// RM_COPIES_READY (revision 8): the copies host functions published, for the client's
    /// callback thread before it runs a callback. Answered on the connection thread with no
    /// driver call and no lock a driver call may hold (see `PendingCopies`).
    fn rm_copies_ready(&self, call: &CallContext) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        Ok(RmSyncReply {
            status: cu::SUCCESS,
            copies: session.copies.take_ready(),
        })
    }

    fn rm_copies_collect(&self, call: &CallContext, ids: Vec<u64>) -> ProcResult<RmSyncReply> {
        self.copies_collect(call, ids)
    }

    // Graphs through stream capture (revision 5) ---------------------------------------------

    fn rm_graph_launch(&self, call: &CallContext, a: RmGraphLaunchArgs) -> ProcResult<()> {
        self.oneway_on_stream(
            call,
            "RM_GRAPH_LAUNCH",
            (a.ctx, a.stream),
            |st| graph_exec_target(st, &a),
            |b, (exec, t)| b.graph_launch(t.ctx, exec, t.stream),
        )?;
        // Its allocations without a free node stay allocated after it (revision 12).
        let session = self.session(call);
        let mut st = session.lock();
        if !st.graph_mem.is_empty() {
            st.graph_mem_launched(a.exec);
        }
        Ok(())
    }

    fn rm_graph_exec_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let r = self.destroy_in_ctx(
            &session,
            h,
            "RM_GRAPH_EXEC_DESTROY",
            |r| match r {
                Resource::GraphExec { raw, ctx } => Ok((*raw, *ctx)),
                _ => Err(CuError(cu::INVALID_HANDLE)),
            },
            |b, c, raw| b.graph_exec_destroy(c, raw),
        );
        let mut st = session.lock();
        if st.get(h).is_err() {
            st.graph_mem_released_by(h);
        }
        Ok(r)
    }

    fn rm_graph_node_set_params(
        &self,
        call: &CallContext,
        a: RmNodeSetArgs,
    ) -> ProcResult<CuResult_> {
        let r = self.node_set_params(call, None, a.node, &a.params);
        Ok(code("RM_GRAPH_NODE_SET_PARAMS", r))
    }

    fn rm_graph_exec_node_set_params(
        &self,
        call: &CallContext,
        a: RmExecNodeSetArgs,
    ) -> ProcResult<CuResult_> {
        let r = self.node_set_params(call, Some(a.exec), a.node, &a.params);
        Ok(code("RM_GRAPH_EXEC_NODE_SET_PARAMS", r))
    }

    fn rm_graph_node_count(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmU64Reply> {
        let session = self.session(call);
        let st = session.lock();
        let r = match st.get(h) {
            Ok(Resource::Graph { raw, ctx, .. }) => st
                .ctx(*ctx)
                .and_then(|c| self.inner.backend.graph_node_count(c, *raw)),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        };
        Ok(u64_reply("RM_GRAPH_NODE_COUNT", r))
    }
}
