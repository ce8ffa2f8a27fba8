//! HELLO end to end: a real server on a Unix socket and over TCP, a generated client, and an
//! inventory with GPUs (given directly, since CI machines have none).

use std::time::Duration;

use remora_oncrpc::{Client, Endpoint, RpcError};
use remora_proto::remora::{
    DriverReport, HelloArgs, HelloReply, REMORA_CAP_ONEWAY, REMORA_PROG, REMORA_PROTOCOL_REVISION,
    RemoraV1Client,
};
use remora_server::driver::{GpuInfo, Inventory};
use remora_server::{ServeConfig, start_with_inventory};

fn gpu(ordinal: i32, name: &str) -> GpuInfo {
    GpuInfo {
        ordinal,
        name: name.into(),
        uuid: [ordinal as u8 + 1; 16],
        total_memory: 80 << 30,
        compute_major: 9,
        compute_minor: 0,
        multiprocessor_count: 132,
        pci_bus_id: format!("0000:0{ordinal}:00.0"),
    }
}

fn hello(endpoint: &Endpoint, min: u32, max: u32) -> Result<HelloReply, RpcError> {
    let client =
        RemoraV1Client::new(Client::connect(endpoint)?).with_timeout(Duration::from_secs(10));
    client.remora_null()?;
    client.remora_hello(&HelloArgs {
        min_revision: min,
        max_revision: max,
        client_name: "hello test".into(),
        capabilities: u64::from(REMORA_CAP_ONEWAY) | 0x8000,
    })
}

#[test]
fn hello_reports_the_selected_gpus_over_unix_and_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let inventory = Inventory::Ok {
        driver_version: 13000,
        devices: vec![gpu(0, "first"), gpu(1, "second")],
    };
    let selected = remora_server::driver::select_devices(inventory, Some(&[1])).unwrap();
    let running = start_with_inventory(
        ServeConfig {
            listen: vec![
                Endpoint::Unix(dir.path().join("r.sock")),
                Endpoint::Tcp("127.0.0.1:0".into()),
            ],
            ..ServeConfig::default()
        },
        selected,
    )
    .unwrap();
    for endpoint in running.endpoints() {
        let HelloReply::True(welcome) = hello(&endpoint, 1, REMORA_PROTOCOL_REVISION).unwrap()
        else {
            panic!("refused over {endpoint}")
        };
        assert_eq!(welcome.revision, REMORA_PROTOCOL_REVISION);
        assert_eq!(
            welcome.capabilities,
            u64::from(REMORA_CAP_ONEWAY),
            "unknown bits dropped"
        );
        let DriverReport::DriverOk(ok) = welcome.driver else {
            panic!("no driver")
        };
        assert_eq!(ok.driver_version, 13000);
        assert_eq!(ok.devices.len(), 1);
        assert_eq!(
            (ok.devices[0].ordinal, ok.devices[0].name.as_str()),
            (0, "second")
        );
        assert_eq!(ok.devices[0].uuid, [2; 16]);
    }
    running.shutdown();
}

#[test]
fn hello_refuses_a_client_from_the_future_and_wrong_programs_get_prog_unavail() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = Endpoint::Unix(dir.path().join("r.sock"));
    let running = start_with_inventory(
        ServeConfig {
            listen: vec![endpoint.clone()],
            ..ServeConfig::default()
        },
        Inventory::NotFound("none here".into()),
    )
    .unwrap();
    let future = REMORA_PROTOCOL_REVISION + 1;
    let HelloReply::False(refused) = hello(&endpoint, future, future + 2).unwrap() else {
        panic!("a client speaking only revisions {future}.. was accepted")
    };
    assert_eq!(
        (refused.min_revision, refused.max_revision),
        (1, REMORA_PROTOCOL_REVISION)
    );
    // A program the server does not serve, and a version it does not have.
    let rpc = Client::connect(&endpoint).unwrap();
    let err = rpc
        .call(REMORA_PROG + 1, 1, 0, None, |_| Ok(()), |_| Ok(()))
        .unwrap_err();
    assert!(matches!(err, RpcError::ProgUnavail { .. }), "{err}");
    let err = rpc
        .call(REMORA_PROG, 2, 0, None, |_| Ok(()), |_| Ok(()))
        .unwrap_err();
    assert!(
        matches!(
            err,
            RpcError::ProgMismatch {
                low: 1,
                high: 1,
                ..
            }
        ),
        "{err}"
    );
    running.shutdown();
}
