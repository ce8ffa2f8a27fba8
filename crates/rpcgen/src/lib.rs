//! remora-rpcgen (being built).
