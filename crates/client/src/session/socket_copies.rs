//! Bulk 1-D copies through the record path (sessions on a socket, or shared memory whose data
//! area has no room): pipelined chunks, each sent from the caller's own memory.
//!
//! ```text
//!  client thread                      socket                 server
//!  start(chunk 0..W-1) ── writev(head, caller's bytes) ──►  connection thread reads chunk i+1
//!  finish(chunk i) ◄──────────────── reply i ◄────────────  waiter thread copies chunk i
//!  start(chunk i+W) ...
//! ```
//!
//! A synchronous copy keeps [`SOCKET_WINDOW`] calls of at most [`SOCKET_CHUNK`] bytes in
//! flight ([`remora_oncrpc::Client::start_call`]) and takes their replies in order, so that
//! sending, the server's receiving and its copy to the device overlap instead of taking
//! turns. Chunks of a few MiB stay in the caches and reuse buffers on both sides (the record
//! reader's and the server's [`remora_oncrpc::recycle::Recycler`]s) instead of faulting in
//! fresh pages. The procedures and their encoding are those of revision 2; a server that runs
//! each call before reading the next is still correct, only slower.

use std::collections::VecDeque;

use remora_oncrpc::PendingCall;
use remora_xdr::{Encoder, XdrDecode, XdrEncode};

use super::*;

/// Bytes per call of a copy through the record path.
pub(crate) const SOCKET_CHUNK: usize = 4 << 20;

/// Calls of one synchronous copy in flight.
const SOCKET_WINDOW: usize = 4;

/// Splits `len` bytes into `(offset, size)` chunks of at most [`SOCKET_CHUNK`] (one empty
/// chunk for `len` = 0, as a zero-byte copy still makes its call).
fn socket_chunks(len: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len.div_ceil(SOCKET_CHUNK).max(1)).map(move |i| {
        let off = i * SOCKET_CHUNK;
        (off, SOCKET_CHUNK.min(len - off))
    })
}

/// The XDR padding after `len` bytes of opaque data.
fn pad(len: usize) -> &'static [u8] {
    const ZEROS: [u8; 3] = [0; 3];
    &ZEROS[..(4 - len % 4) % 4]
}

/// `rm_htod_args` up to its data bytes: `ctx`, `stream`, `dst` and the data's length. The
/// bytes and their [`pad`] follow as raw slices.
fn htod_head(
    enc: &mut Encoder,
    ctx: RmHandle,
    stream: RmHandle,
    dst: u64,
    len: usize,
) -> remora_xdr::Result<()> {
    enc.put_u64(ctx);
    enc.put_u64(stream);
    enc.put_u64(dst);
    enc.put_len(len, RM_MAX_COPY)
}

impl Session {
    /// `cuMemcpyHtoD` (`oneway` false) or `cuMemcpyHtoDAsync` (true) through the record path.
    pub(super) fn htod_socket(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        data: &[u8],
        oneway: bool,
    ) -> CuResult<()> {
        let rpc = self.rpc.rpc();
        let (proc, name) = if oneway {
            (RM_MEMCPY_HTOD_ASYNC, "rm_memcpy_htod_async")
        } else {
            (RM_MEMCPY_HTOD, "rm_memcpy_htod")
        };
        self.coherent(name, || {
            let mut window: VecDeque<PendingCall> = VecDeque::new();
            let mut first_err: Option<CuError> = None;
            for (off, len) in socket_chunks(data.len()) {
                let part = &data[off..off + len];
                let head = |enc: &mut Encoder| htod_head(enc, ctx, stream, dst + off as u64, len);
                if oneway {
                    rpc.call_oneway_raw(REMORA_PROG, REMORA_V1, proc, head, &[part, pad(len)])
                        .map_err(|e| from_rpc(name, e))?;
                    continue;
                }
                if window.len() == SOCKET_WINDOW
                    && let Some(p) = window.pop_front()
                {
                    self.finish_htod_chunk(p, &mut first_err);
                }
                // After a failed chunk the copy has failed: send no more.
                if first_err.is_some() {
                    break;
                }
                let timeout = self.rpc.timeout();
                match rpc.start_call(
                    REMORA_PROG,
                    REMORA_V1,
                    proc,
                    timeout,
                    head,
                    &[part, pad(len)],
                ) {
                    Ok(p) => window.push_back(p),
                    Err(e) => {
                        first_err.get_or_insert(from_rpc(name, e));
                        break;
                    }
                }
            }
            // Every reply is taken, also after an error: each may deliver completed copies.
            while let Some(p) = window.pop_front() {
                self.finish_htod_chunk(p, &mut first_err);
            }
            first_err.map_or(Ok(()), Err)
        })
    }

    fn finish_htod_chunk(&self, p: PendingCall, first_err: &mut Option<CuError>) {
        let r = p
            .finish(RmSyncReply::decode)
            .map_err(|e| from_rpc("rm_memcpy_htod", e))
            .and_then(|r| self.finish_sync(r));
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }

    /// `cuMemcpyDtoH` through the record path, into `out`.
    pub(super) fn dtoh_socket(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        out: &mut [u8],
    ) -> CuResult<()> {
        let rpc = self.rpc.rpc();
        let name = "rm_memcpy_dtoh";
        self.coherent(name, || {
            let mut window: VecDeque<(PendingCall, usize, usize)> = VecDeque::new();
            let mut first_err: Option<CuError> = None;
            let mut chunks = socket_chunks(out.len());
            loop {
                // Keep the window full while chunks remain and nothing failed.
                while window.len() < SOCKET_WINDOW && first_err.is_none() {
                    let Some((off, len)) = chunks.next() else {
                        break;
                    };
                    let args = RmDtohArgs {
                        ctx,
                        stream,
                        src: src + off as u64,
                        size: len as u64,
                        copy_id: 0,
                    };
                    let timeout = self.rpc.timeout();
                    match rpc.start_call(
                        REMORA_PROG,
                        REMORA_V1,
                        RM_MEMCPY_DTOH,
                        timeout,
                        |enc| args.encode(enc),
                        &[],
                    ) {
                        Ok(p) => window.push_back((p, off, len)),
                        Err(e) => {
                            first_err = Some(from_rpc(name, e));
                        }
                    }
                }
                let Some((p, off, len)) = window.pop_front() else {
                    break;
                };
                let r = p
                    .finish(RmDtohReply::decode)
                    .map_err(|e| from_rpc(name, e))
                    .and_then(|r| {
                        self.finish_sync(RmSyncReply {
                            status: r.status,
                            copies: r.copies,
                        })?;
                        if r.data.len() != len {
                            tracing::error!(
                                "remora: DtoH of {len} bytes returned {}",
                                r.data.len()
                            );
                            return Err(CuError(cu::UNKNOWN));
                        }
                        out[off..off + len].copy_from_slice(&r.data);
                        Ok(())
                    });
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            }
            first_err.map_or(Ok(()), Err)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn htod_head_and_raw_tail_encode_as_rm_htod_args() {
        for len in [0usize, 1, 2, 3, 4, 5, 4097] {
            let data: Vec<u8> = (0..len).map(|i| i as u8 ^ 0x5a).collect();
            let mut want = Encoder::new();
            RmHtodArgs {
                ctx: 7,
                stream: 9,
                dst: 0x1234_5678_9abc,
                data: Bytes::copy_from_slice(&data),
            }
            .encode(&mut want)
            .unwrap();
            let mut got = Encoder::new();
            htod_head(&mut got, 7, 9, 0x1234_5678_9abc, len).unwrap();
            let mut got = got.to_bytes().to_vec();
            got.extend_from_slice(&data);
            got.extend_from_slice(pad(len));
            assert_eq!(got, want.to_bytes().to_vec(), "len {len}");
        }
    }

    #[test]
    fn socket_chunks_cover_every_byte_once() {
        assert_eq!(socket_chunks(0).collect::<Vec<_>>(), [(0, 0)]);
        let n = 3 * SOCKET_CHUNK + 5;
        let c: Vec<_> = socket_chunks(n).collect();
        assert_eq!(c.len(), 4);
        assert_eq!(c[3], (3 * SOCKET_CHUNK, 5));
        assert_eq!(c.iter().map(|x| x.1).sum::<usize>(), n);
    }
}
