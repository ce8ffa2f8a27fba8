//! `remora serve`: the GPU-side server of Remora.
//!
//! ```text
//! client ──ONC RPC──► remora-oncrpc Server ──► RemoraV1Service<Hello> ──► Inventory
//!                                                                  (real libcuda.so.1)
//! ```
//!
//! Today the server answers `REMORA_NULL` and `REMORA_HELLO` (protocol negotiation, server
//! identity and the GPU list). The CUDA driver-API executor arrives with issue 3 and plugs in
//! beside the HELLO service.

pub mod driver;
mod hello;
mod serve;

pub use hello::{HelloService, SERVER_VERSION};
pub use serve::{Running, ServeConfig, ServeError, default_endpoint, start, start_with_inventory};
