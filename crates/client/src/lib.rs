//! Remora's client: CUDA driver calls carried over ONC RPC to `remora serve`.
//!
//! Two layers:
//! - [`Session`], the low-level layer the `libcuda.so.1` shim is built on: one connection,
//!   a method per protocol procedure returning `Result<T, CuError>`, the hash-first module
//!   load, kernel-parameter packing, asynchronous device-to-host copy bookkeeping, stream
//!   handle mapping and the client-side reservation of device address ranges;
//! - the safe API ([`Client`], [`Device`], [`Context`], [`DeviceBuffer`], [`Module`],
//!   [`Function`], [`Stream`], [`Event`]): RAII wrappers that free what they own on drop.
//!
//! ```no_run
//! use remora_client::{Client, Context, DeviceBuffer};
//! let client = Client::connect("unix:///run/user/1000/remora/remora.sock")?;
//! let device = client.device(0)?;
//! println!("{} with {} bytes", device.name()?, device.total_memory()?);
//! let ctx = Context::new(&device)?;
//! let buf = DeviceBuffer::from_slice(&ctx, &[1u32, 2, 3])?;
//! assert_eq!(buf.to_vec()?, vec![1, 2, 3]);
//! # Ok::<(), remora_client::CuError>(())
//! ```

mod area;
mod call_profile;
pub mod copy3d;
mod delivery;
mod endpoint;
mod error;
pub mod host;
mod host_callbacks;
pub mod launch;
mod library;
mod mirror;
pub mod params;
mod safe;
mod session;
mod stdout;
mod vaspace;

pub use endpoint::{
    AuthToken, auth_token_from_env, default_endpoint, endpoint_from_env, transport_from_env,
};
pub use error::{
    CuError, CuResult, TransportFailure, cu, cu_result_name, cu_result_name_c, cu_result_string,
    cu_result_string_c, cu_results, from_rpc, last_transport_failure,
};
pub use host_callbacks::{HostCallback, RepeatedCallback, in_host_callback};
pub use remora_oncrpc::{Endpoint, TransportChoice};
pub use remora_proto::mem_prop as proto_mem_prop;
pub use remora_proto::memset_node as proto_memset_node;
pub use remora_proto::pool_access as proto_pool_access;
pub use remora_proto::remora as proto;
pub use remora_proto::stream_attr as proto_stream_attr;
pub use remora_proto::uuid_groups;
pub use remora_shm::tracing_waits;
pub use safe::{
    Client, Context, Device, DeviceBuffer, Dim3, Event, Function, KernelArg, Module, Pod, Stream,
};
pub use session::{
    BandSink, CaptureInfo, Copy3dParams, CopyDst, CopySink, CopySrc, DeviceHandle, ExecUpdateInfo,
    FunctionInfo, KernelArgs, LaunchAttr, LaunchConfig, ModuleInfo, NodeList, PinnedCopy,
    PointerKind, Session, SessionConfig, StagedSide, StreamRef, UNSUPPORTED_MEMORY_ATTRIBUTES,
};
