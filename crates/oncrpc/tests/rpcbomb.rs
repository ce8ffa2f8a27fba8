//! "rpcbomb": many connections declaring huge records and sending little must not make the
//! server's memory grow, and other clients must still be served. Its own test binary so that
//! no other test's allocations disturb the RSS measurement.

mod common;

use std::io::Write;
use std::time::Duration;

use common::*;
use remora_oncrpc::{Client, ServerConfig};

#[test]
fn rpcbomb_50_connections_declaring_2_gib() {
    // Allow records up to 4 GiB so that the declared lengths are accepted and the reader's
    // growth-only-with-data behaviour is what bounds memory.
    let s = start_with(
        Transport::Tcp,
        ServerConfig {
            max_record_size: 4 << 30,
            ..ServerConfig::default()
        },
    );
    let c = Client::connect(&s.endpoint).unwrap();
    let ping = || {
        c.call(
            PROG,
            1,
            NULLPROC,
            Some(Duration::from_secs(5)),
            |_| Ok(()),
            |_| Ok(()),
        )
        .unwrap()
    };
    ping();
    let before = rss_bytes();
    let mut bombs = Vec::new();
    for _ in 0..50 {
        let mut raw = Raw::connect(&s.endpoint);
        // A 2 GiB record: a non-last fragment of 2^31 - 1 bytes, then 1 more byte to come.
        raw.write_all(&[0x7f, 0xff, 0xff, 0xff]).unwrap();
        raw.write_all(&[0xab; 1000]).unwrap();
        bombs.push(raw);
    }
    // Let every connection thread read what was sent.
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..20 {
        ping();
    }
    assert_eq!(s.handle().connection_count(), 51);
    let after = rss_bytes();
    let grown = after.saturating_sub(before);
    eprintln!("RSS before {before} after {after}: grew {grown} bytes for 50 bombs");
    assert!(grown < 4 * 1024 * 1024, "RSS grew by {grown} bytes");
    drop(bombs);
}

#[test]
fn rpcbomb_default_config_rejects_at_header() {
    let s = start(Transport::Unix);
    let mut bombs = Vec::new();
    for _ in 0..50 {
        let mut raw = Raw::connect(&s.endpoint);
        raw.write_all(&[0x7f, 0xff, 0xff, 0xff]).unwrap();
        bombs.push(raw);
    }
    for raw in &mut bombs {
        assert!(raw.closed_within(Duration::from_secs(3)));
    }
    let c = Client::connect(&s.endpoint).unwrap();
    c.call(PROG, 1, NULLPROC, None, |_| Ok(()), |_| Ok(()))
        .unwrap();
}
