//! `remora info`: print a server's HELLO answer in a readable form.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use remora_oncrpc::{ClientConfig, Endpoint};
use remora_proto::remora::{
    DriverReport, HelloArgs, HelloReply, REMORA_CAP_ONEWAY, REMORA_PROTOCOL_REVISION,
    RemoraV1Client,
};

/// Connects to `server`, says HELLO and prints the answer.
pub(crate) fn run(server: &Endpoint) -> Result<()> {
    let rpc = crate::connect(server, ClientConfig::default())?;
    let client = RemoraV1Client::new(rpc).with_timeout(Duration::from_secs(30));
    let reply = client
        .remora_hello(&HelloArgs {
            min_revision: 1,
            max_revision: REMORA_PROTOCOL_REVISION,
            client_name: concat!("remora info ", env!("CARGO_PKG_VERSION")).into(),
            capabilities: u64::from(REMORA_CAP_ONEWAY),
        })
        .with_context(|| format!("HELLO to {server} failed"))?;
    outln!("{}", render(server, &reply)?.trim_end_matches('\n'));
    Ok(())
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

fn uuid(bytes: &[u8; 16]) -> String {
    let h: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
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
