//! `remora info`: print a server's HELLO answer in a readable form.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use remora_oncrpc::{ClientConfig, Endpoint};
use remora_proto::remora::{
    DriverReport, HelloArgs, HelloReply, REMORA_CAP_NO_SESSION, REMORA_CAP_ONEWAY,
    REMORA_PROTOCOL_REVISION, RemoraV1Client,
};

/// Connects to `server` (a `tls://` one with `tls`, else the environment's TLS settings),
/// says HELLO (HELLO_AUTH with `token`) and prints the answer.
pub(crate) fn run(
    server: &Endpoint,
    token: Option<&str>,
    tls: Option<std::sync::Arc<remora_oncrpc::ClientTls>>,
) -> Result<()> {
    let reply = hello_with(server, token, tls)?;
    outln!("{}", render(server, &reply)?.trim_end_matches('\n'));
    Ok(())
}

/// Connects to `server`, says HELLO (HELLO_AUTH with `token`) and returns the answer.
pub(crate) fn hello(server: &Endpoint, token: Option<&str>) -> Result<HelloReply> {
    hello_with(server, token, None)
}

/// [`hello`] with the TLS settings `tls` for a `tls://` server.
fn hello_with(
    server: &Endpoint,
    token: Option<&str>,
    tls: Option<std::sync::Arc<remora_oncrpc::ClientTls>>,
) -> Result<HelloReply> {
    let name = concat!("remora info ", env!("CARGO_PKG_VERSION"));
    connect_hello(server, token, tls, name).map(|(_, reply)| reply)
}

/// Connects to `server` as `client_name`, says HELLO (HELLO_AUTH with `token`) and returns
/// the connection with the answer.
pub(crate) fn connect_hello(
    server: &Endpoint,
    token: Option<&str>,
    tls: Option<std::sync::Arc<remora_oncrpc::ClientTls>>,
    client_name: &str,
) -> Result<(RemoraV1Client, HelloReply)> {
    let hello = HelloArgs {
        min_revision: 1,
        max_revision: REMORA_PROTOCOL_REVISION,
        client_name: client_name.into(),
        // No session: these commands make no CUDA calls, and must not count against (or be
        // refused for) the tenant's sessions.
        capabilities: u64::from(REMORA_CAP_ONEWAY | REMORA_CAP_NO_SESSION),
    };
    let config = ClientConfig {
        opening_call: crate::opening_call(&hello, token)?,
        // A plain socket: a few calls need no shared-memory region (whose data area the
        // server would count as page-locked memory of this session).
        transport: if matches!(server, Endpoint::Unix(_)) {
            remora_oncrpc::TransportChoice::Unix
        } else {
            remora_oncrpc::TransportChoice::Auto
        },
        tls,
        ..ClientConfig::default()
    };
    let rpc = crate::connect(server, config)?;
    let opening = rpc.opening_reply().cloned();
    let client = RemoraV1Client::new(rpc).with_timeout(Duration::from_secs(30));
    let reply = match opening {
        Some(bytes) => {
            let mut dec = remora_oncrpc::xdr::Decoder::new(bytes);
            let reply: HelloReply = remora_oncrpc::xdr::XdrDecode::decode(&mut dec)
                .and_then(|r| dec.finish().map(|()| r))
                .with_context(|| format!("the answer to HELLO_AUTH from {server} is malformed"))?;
            reply
        }
        None => client
            .remora_hello(&hello)
            .map_err(|e| crate::auth_error(e, server, false))
            .with_context(|| format!("HELLO to {server} failed"))?,
    };
    Ok((client, reply))
}

/// The name of the server's first GPU, as its driver reports it; `None` when it serves none
/// or refused the handshake.
pub(crate) fn first_device_name(reply: &HelloReply) -> Option<String> {
    match reply {
        HelloReply::True(w) => match &w.driver {
            DriverReport::DriverOk(ok) => ok.devices.first().map(|d| d.name.clone()),
            DriverReport::Default { .. } => None,
        },
        HelloReply::False(_) => None,
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

fn uuid(bytes: &[u8; 16]) -> String {
    format!("GPU-{}", remora_proto::uuid_groups(bytes, false))
}

/// Formats a HELLO reply.
pub(crate) fn render(server: &Endpoint, reply: &HelloReply) -> Result<String> {
    let welcome = match reply {
        HelloReply::True(w) => w,
        HelloReply::False(r) => bail!(
            "the server at {server} refused the handshake: {} (it speaks revisions {}..={})",
            r.reason,
            r.min_revision,
            r.max_revision
        ),
    };
    let mut out = String::new();
    let caps = if welcome.capabilities & u64::from(REMORA_CAP_ONEWAY) != 0 {
        "oneway"
    } else {
        "none"
    };
    writeln!(out, "server        {server}")?;
    writeln!(
        out,
        "version       {} (protocol revision {})",
        welcome.server_version, welcome.revision
    )?;
    writeln!(out, "host          {}", welcome.hostname)?;
    writeln!(out, "capabilities  {caps}")?;
    match &welcome.driver {
        DriverReport::DriverOk(ok) => {
            let v = ok.driver_version;
            writeln!(
                out,
                "driver        CUDA {}.{} ({v})",
                v / 1000,
                (v % 1000) / 10
            )?;
            writeln!(out, "GPUs          {}", ok.devices.len())?;
            for d in &ok.devices {
                writeln!(
                    out,
                    "  [{}] {}  sm_{}{}  {} SMs  {:.1} GiB  {}  {}",
                    d.ordinal,
                    d.name,
                    d.compute_major,
                    d.compute_minor,
                    d.multiprocessor_count,
                    gib(d.total_memory),
                    d.pci_bus_id,
                    uuid(&d.uuid)
                )?;
            }
        }
        DriverReport::Default { value: reason, .. } => {
            writeln!(out, "driver        none: {reason}")?;
            writeln!(out, "GPUs          0")?;
        }
    }
    Ok(out)
}
