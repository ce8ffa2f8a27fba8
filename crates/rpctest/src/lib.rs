//! `rpctest.x`, a test and benchmark service for Remora's ONC RPC toolkit.
//!
//! ```text
//!            rpctest.x
//!          /           \
//!   remora-rpcgen     Debian rpcgen -N -M
//!   (build.rs)        (c/build.sh)
//!      │                  │
//!   Rust client  ◄──►  C server (libtirpc)      interop tests: tests/interop.rs
//!   Rust server  ◄──►  C client (libtirpc)      benchmark:     `remora bench rpc`
//! ```
//!
//! The same `.x` file is compiled by both generators, so every construct in it (unions with
//! shared and default arms, optional-data lists, fixed and variable arrays, fixed opaque,
//! bounded strings, multi-argument procedures, 64 MiB opaque) is checked against a real peer.

pub mod bench;
pub mod peers;
mod service;

pub use service::RtService;

remora_xdr::include_generated! {
    /// Code generated from `x/rpctest.x` by `remora-rpcgen` at build time.
    pub mod rpctest = "rpctest.rs";
}
