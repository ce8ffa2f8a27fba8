//! Entry points for fuzz targets. Not a stable API.
//!
//! Both functions must return normally for every input; a panic is a bug.

use std::io::{self, Read, Write};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use remora_xdr::{Decoder, Encoder};

use crate::record::RecordReader;
use crate::server::{Registry, ServerConfig, Transport, serve_connection};
use crate::{CallContext, Dispatch, Peer, Service};

/// Maximum record size used by the fuzzing entry points.
pub const FUZZ_MAX_RECORD: usize = 64 * 1024;

/// Feeds `data` through the record reader (maximum record size [`FUZZ_MAX_RECORD`]), both
/// in one piece and in small pieces, reading records until the end or the first error.
pub fn deframe(data: &[u8]) {
    let mut r = RecordReader::new(data, FUZZ_MAX_RECORD);
    while let Ok(Some(_)) = r.read_record() {}
    let mut r = RecordReader::new(Dribble { data, step: 3 }, FUZZ_MAX_RECORD);
    while let Ok(Some(_)) = r.read_record() {}
}

/// A reader handing out at most `step` bytes per read.
struct Dribble<'a> {
    data: &'a [u8],
    step: usize,
}

impl Read for Dribble<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.step).min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

/// An in-memory connection: reads come from the input, writes are counted and dropped.
struct MemStream<'a> {
    input: &'a [u8],
    written: usize,
}

impl Read for MemStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for MemStream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.written += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Transport for MemStream<'_> {}

/// Program number of the fuzzing test service (versions 1 and 2 are served).
pub const FUZZ_PROGRAM: u32 = 0x2000_f022;

/// A small service exercising argument decoding: 1 echoes an `opaque<>`, 2 adds two
/// `int`s, 3 fails with SYSTEM_ERR, 4 is one-way, 5 decodes a linked list of `int`s.
struct FuzzService(u32);

impl Service for FuzzService {
    fn program(&self) -> u32 {
        FUZZ_PROGRAM
    }
    fn version(&self) -> u32 {
        self.0
    }
    fn dispatch(&self, ctx: &CallContext, args: &mut Decoder, reply: &mut Encoder) -> Dispatch {
        fn list(d: &mut Decoder) -> crate::xdr::Result<u32> {
            let _ = d.get_i32()?;
            Ok(d.get_option(list)?.map_or(1, |n| n + 1))
        }
        let res = match ctx.procedure {
            0 => args.finish(),
            1 => args.get_opaque(crate::xdr::UNBOUNDED).and_then(|b| {
                args.finish()?;
                reply.put_opaque_bytes(&b, crate::xdr::UNBOUNDED)
            }),
            2 => (|| {
                let a = args.get_i32()?;
                let b = args.get_i32()?;
                args.finish()?;
                reply.put_i32(a.wrapping_add(b));
                Ok(())
            })(),
            3 => return Dispatch::SystemErr,
            4 => {
                return match args.finish() {
                    Ok(()) => Dispatch::NoReply,
                    Err(_) => Dispatch::GarbageArgs,
                };
            }
            5 => list(args).and_then(|n| {
                args.finish()?;
                reply.put_u32(n);
                Ok(())
            }),
            _ => return Dispatch::ProcUnavail,
        };
        match res {
            Ok(()) => Dispatch::Success,
            Err(_) => Dispatch::GarbageArgs,
        }
    }
}

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut r = Registry::default();
        r.add(Arc::new(FuzzService(1)));
        r.add(Arc::new(FuzzService(2)));
        r
    })
}

/// Feeds `data` as the byte stream of one connection into the server's per-connection
/// logic (record reading, header decoding, authentication, dispatch, replies) with a test
/// service registered. Returns the number of reply bytes written.
pub fn dispatch(data: &[u8]) -> usize {
    let config = ServerConfig {
        max_record_size: FUZZ_MAX_RECORD,
        stall_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    };
    let mut stream = MemStream {
        input: data,
        written: 0,
    };
    serve_connection(
        &mut stream,
        &Peer::Unknown,
        0,
        registry(),
        &config,
        &AtomicBool::new(false),
        &crate::Origin::default(),
        std::time::Instant::now(),
    );
    stream.written
}
