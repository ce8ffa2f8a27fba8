//! remora-server (being built).
