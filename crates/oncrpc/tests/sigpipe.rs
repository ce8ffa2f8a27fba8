//! A client whose server has closed the connection gets an error, not SIGPIPE: the client
//! runs inside programs that keep SIGPIPE's default action (a C program under the shim), which
//! would end the program at the first write to the dead socket. This test binary restores
//! the default action (Rust's runtime ignores SIGPIPE) and holds this one test alone, so
//! that nothing else in the process writes to a closed socket.

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::time::Duration;

use remora_oncrpc::{Client, ClientConfig, Endpoint, TransportChoice};

#[test]
fn writing_to_a_closed_connection_is_an_error_not_sigpipe() {
    // SAFETY: restoring a signal's default action; this test binary has no other test and no
    // handler of its own for SIGPIPE.
    let previous = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    assert_ne!(previous, libc::SIG_ERR);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("closing.sock");
    let listener = UnixListener::bind(&path).unwrap();
    // A "server" that takes the connection, reads a little, and hangs up.
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 4];
        let _ = s.read(&mut buf);
        drop(s);
    });
    let client = Client::connect_with(
        &Endpoint::Unix(path),
        ClientConfig {
            transport: TransportChoice::Unix,
            ..ClientConfig::default()
        },
    )
    .unwrap();
    let call = |n: usize| {
        client.call(
            0x2000_0001,
            1,
            1,
            Some(Duration::from_secs(5)),
            |e| {
                e.put_raw(&vec![0u8; n]);
                Ok(())
            },
            |d| d.get_u32(),
        )
    };
    // The first call is larger than the socket's buffers: the server hangs up while the
    // client is still writing it, so the client's next write meets a closed socket (EPIPE).
    assert!(call(8 << 20).is_err());
    server.join().unwrap();
    // Later calls and one-way calls: errors, and this process is still alive.
    assert!(call(1 << 20).is_err());
    let oneway = client.call_oneway(0x2000_0001, 1, 2, |e| {
        e.put_raw(&[0u8; 64]);
        Ok(())
    });
    assert!(oneway.is_err() || call(8).is_err());
}
