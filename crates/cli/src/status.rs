//! `remora status`: what a server's sessions use, per tenant (`REMORA_STATUS`, revision 15),
//! beside its GPUs, like `nvidia-smi` for Remora.

use std::fmt::Write as _;

use anyhow::{Context, Result, bail};
use remora_oncrpc::Endpoint;
use remora_proto::remora::{DriverReport, HelloReply, StatusReply};

/// The revision that has `REMORA_STATUS`.
const STATUS_REVISION: u32 = 15;

/// Connects to `server`, asks for its status and prints it.
pub(crate) fn run(
    server: &Endpoint,
    token: Option<&str>,
    tls: Option<std::sync::Arc<remora_oncrpc::ClientTls>>,
) -> Result<()> {
    let name = concat!("remora status ", env!("CARGO_PKG_VERSION"));
    let (client, reply) = crate::info::connect_hello(server, token, tls, name)?;
    let HelloReply::True(welcome) = &reply else {
        // The refusal's reason, as `remora info` words it.
        crate::info::render(server, &reply)?;
        bail!("the server at {server} refused the handshake");
    };
    if welcome.revision < STATUS_REVISION {
        bail!(
            "the server at {server} ({}) speaks protocol revision {}, which has no status; \
             `remora status` needs revision {STATUS_REVISION} (upgrade the server)",
            welcome.server_version,
            welcome.revision
        );
    }
    let status = client
        .remora_status()
        .map_err(|e| crate::auth_error(e, server, false))
        .with_context(|| format!("REMORA_STATUS to {server} failed"))?;
    outln!(
        "{}",
        render(server, &reply, &status)?.trim_end_matches('\n')
    );
    Ok(())
}

fn size(bytes: u64) -> String {
    let mut v = bytes as f64;
    for unit in ["B", "KiB", "MiB", "GiB", "TiB"] {
        if v < 1024.0 || unit == "TiB" {
            return if unit == "B" {
                format!("{bytes} B")
            } else {
                format!("{v:.1} {unit}")
            };
        }
        v /= 1024.0;
    }
    unreachable!("the loop returns at TiB")
}

/// Formats a status: the server, its GPUs, then one row per tenant.
pub(crate) fn render(server: &Endpoint, hello: &HelloReply, s: &StatusReply) -> Result<String> {
    let mut out = String::new();
    if let HelloReply::True(w) = hello {
        writeln!(
            out,
            "{server}  {} on {}  {} session{}",
            w.server_version,
            w.hostname,
            s.sessions,
            if s.sessions == 1 { "" } else { "s" }
        )?;
        match &w.driver {
            DriverReport::DriverOk(ok) => {
                for d in &ok.devices {
                    writeln!(
                        out,
                        "GPU {}  {}  {} total",
                        d.ordinal,
                        d.name,
                        size(d.total_memory)
                    )?;
                }
            }
            DriverReport::Default { value: reason, .. } => writeln!(out, "no GPUs: {reason}")?,
        }
    }
    let used: u64 = s.tenants.iter().map(|t| t.device_memory).sum();
    writeln!(
        out,
        "device memory in use by {}: {} (all GPUs; GPU utilisation is not measured)",
        if s.all_tenants {
            "all tenants"
        } else {
            "your tenant"
        },
        size(used)
    )?;
    writeln!(
        out,
        "{:<24} {:>8} {:>12} {:>12} {:>12} {:>8} {:>8} {:>8} {:>8}",
        "TENANT",
        "SESSIONS",
        "DEVICE MEM",
        "PINNED",
        "IN FLIGHT",
        "STREAMS",
        "EVENTS",
        "MODULES",
        "REFUSED"
    )?;
    for t in &s.tenants {
        writeln!(
            out,
            "{:<24} {:>8} {:>12} {:>12} {:>12} {:>8} {:>8} {:>8} {:>8}",
            t.name,
            t.sessions,
            size(t.device_memory),
            size(t.pinned_memory),
            size(t.in_flight),
            t.streams,
            t.events,
            t.modules,
            t.refusals
        )?;
    }
    if s.tenants.is_empty() {
        writeln!(out, "(no sessions)")?;
    }
    if !s.all_tenants {
        writeln!(
            out,
            "(only your own tenant is shown: this server authenticates its clients)"
        )?;
    }
    Ok(out)
}
