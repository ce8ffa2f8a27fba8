//! remora-proto (being built).
