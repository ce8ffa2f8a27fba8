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
pub(super) fn pad(len: usize) -> &'static [u8] {
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

/// Call-profile rows (`REMORA_CLIENT_PROFILE`) of the record path's bulk copies: waiting for
/// a chunk's reply (summed over the connections that carry a striped copy), copying a
/// device-to-host chunk's bytes out of its reply, and the striped part of copies (wall time).
const HTOD_WAIT_ROW: &str = "(within calls: socket htod reply wait)";
const DTOH_WAIT_ROW: &str = "(within calls: socket dtoh reply wait)";
const DTOH_COPY_ROW: &str = "(within calls: socket dtoh copy-out)";
const STRIPED_ROW: &str = "(within calls: striped copy after chunk 0)";

/// Asynchronous device-to-host copies into pageable memory over a socket of at least this
/// many bytes go as the driver runs them, pipelined (`Session::memcpy_dtoh_pageable`); smaller
/// ones stay one-way, their bytes in a later synchronizing reply.
pub(crate) const STREAM_DTOH_MIN: usize = 2 * SOCKET_CHUNK;

/// Whether large asynchronous reads into pageable memory go as the driver runs them
/// ([`Session::memcpy_dtoh_pageable`]); `REMORA_DTOH_STREAM=0` keeps them one-way, delivered
/// by a later synchronizing reply, as before revision 17.
fn stream_dtoh_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("REMORA_DTOH_STREAM").map_or(true, |v| v.trim() != "0"))
}

/// Which device-to-host procedure a copy's chunks use.
#[derive(Clone, Copy)]
enum DtohProc {
    /// `RM_MEMCPY_DTOH`: `cuMemcpyDtoH`, ordered by the legacy stream.
    Legacy,
    /// `RM_MEMCPY_DTOH_STREAM` (revision 17): in the order of the call's stream.
    Stream,
}

impl DtohProc {
    fn procedure(self) -> u32 {
        match self {
            Self::Legacy => RM_MEMCPY_DTOH,
            Self::Stream => RM_MEMCPY_DTOH_STREAM,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Legacy => "rm_memcpy_dtoh",
            Self::Stream => "rm_memcpy_dtoh_stream",
        }
    }
}

/// The first error of a copy's chunks, kept across the connections that carry them.
type FirstErr = Option<CuError>;

impl Session {
    /// `cuMemcpyHtoD` (`oneway` false) or `cuMemcpyHtoDAsync` (true) through the record path.
    /// A copy of [`lanes::STRIPE_MIN`] or more is striped over the session's lanes when it has
    /// them ([`Session::striped`]; an asynchronous one with a server of revision 17 or later,
    /// [`Session::async_lanes`]): it returns once every chunk is on the stream, as natively a
    /// copy from pageable memory returns once its bytes are staged.
    pub(super) fn htod_socket(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        data: &[u8],
        oneway: bool,
    ) -> CuResult<()> {
        let name = if oneway {
            "rm_memcpy_htod_async"
        } else {
            "rm_memcpy_htod"
        };
        self.coherent(name, || {
            let parts: Vec<(u64, &[u8])> = socket_chunks(data.len())
                .map(|(off, len)| (dst + off as u64, &data[off..off + len]))
                .collect();
            if !oneway {
                return self.striped(data.len(), parts, |rpc, parts| {
                    self.htod_chunks(rpc, ctx, stream, parts)
                });
            }
            if let Some(lanes) = self.async_lanes(data.len(), parts.len()) {
                return self.striped_with(lanes, parts, |rpc, parts| {
                    self.htod_async_chunks(rpc, ctx, stream, parts)
                });
            }
            for (addr, part) in parts {
                self.send_htod_async(self.rpc.rpc(), ctx, stream, addr, part)?;
            }
            Ok(())
        })
    }

    /// One chunk of an asynchronous host-to-device copy, one-way (`RM_MEMCPY_HTOD_ASYNC`) on
    /// `rpc`, its bytes sent from the caller's memory.
    fn send_htod_async(
        &self,
        rpc: &remora_oncrpc::Client,
        ctx: RmHandle,
        stream: RmHandle,
        addr: u64,
        part: &[u8],
    ) -> CuResult<()> {
        let len = part.len();
        let head = |enc: &mut Encoder| htod_head(enc, ctx, stream, addr, len);
        rpc.call_oneway_raw(
            REMORA_PROG,
            REMORA_V1,
            RM_MEMCPY_HTOD_ASYNC,
            head,
            &[part, pad(len)],
        )
        .map_err(|e| from_rpc("rm_memcpy_htod_async", e))
    }

    /// The lanes an asynchronous host-to-device copy of `total` bytes in `chunks` chunks is
    /// striped over: from [`lanes::STRIPE_MIN`] bytes, with a server of revision 17 or later
    /// (an older one serves no one-way copy on a lane, and a one-way call is not answered:
    /// the chunk would be lost), when the session has lanes. `None`: the copy goes on the
    /// session's own connection.
    fn async_lanes(&self, total: usize, chunks: usize) -> Option<&[RemoraV1Client]> {
        if total < lanes::STRIPE_MIN || chunks < 2 || self.welcome.revision < 17 {
            return None;
        }
        Some(self.lanes()).filter(|l| !l.is_empty())
    }

    /// Sends `parts` (device address, bytes) on `rpc` as one-way `RM_MEMCPY_HTOD_ASYNC` calls
    /// on `stream`, then a `REMORA_NULL` call and waits for its answer: the connection's
    /// calls are read and run (enqueued on the stream) in order, so the answer says every
    /// chunk is on the stream. A chunk's own error is deferred by the server to the session's
    /// next synchronizing call, as for an unstriped asynchronous copy. The first error.
    fn htod_async_chunks(
        &self,
        rpc: &remora_oncrpc::Client,
        ctx: RmHandle,
        stream: RmHandle,
        parts: Vec<(u64, &[u8])>,
    ) -> FirstErr {
        for (addr, part) in parts {
            if let Err(e) = self.send_htod_async(rpc, ctx, stream, addr, part) {
                return Some(e);
            }
        }
        rpc.start_call(
            REMORA_PROG,
            REMORA_V1,
            REMORA_NULL,
            self.rpc.timeout(),
            |_| Ok(()),
            &[],
        )
        .and_then(|p| p.finish(|_| Ok(())))
        .err()
        .map(|e| from_rpc("rm_memcpy_htod_async", e))
    }

    /// Sends `parts` (device address, bytes) on `rpc` as synchronous `RM_MEMCPY_HTOD` calls,
    /// [`SOCKET_WINDOW`] in flight; every reply is taken, also after an error. The first error.
    fn htod_chunks(
        &self,
        rpc: &remora_oncrpc::Client,
        ctx: RmHandle,
        stream: RmHandle,
        parts: Vec<(u64, &[u8])>,
    ) -> FirstErr {
        let name = "rm_memcpy_htod";
        let mut window: VecDeque<PendingCall> = VecDeque::new();
        let mut first_err: FirstErr = None;
        for (addr, part) in parts {
            let len = part.len();
            let head = |enc: &mut Encoder| htod_head(enc, ctx, stream, addr, len);
            if window.len() == SOCKET_WINDOW
                && let Some(p) = window.pop_front()
            {
                self.finish_htod_chunk(p, &mut first_err);
            }
            // After a failed chunk the copy has failed: send no more.
            if first_err.is_some() {
                break;
            }
            match rpc.start_call(
                REMORA_PROG,
                REMORA_V1,
                RM_MEMCPY_HTOD,
                self.rpc.timeout(),
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
        first_err
    }

    fn finish_htod_chunk(&self, p: PendingCall, first_err: &mut FirstErr) {
        let r = self
            .profiled_within(HTOD_WAIT_ROW, || p.finish(RmSyncReply::decode))
            .map_err(|e| from_rpc("rm_memcpy_htod", e))
            .and_then(|r| self.finish_sync(r));
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }

    /// `cuMemcpyDtoH` through the record path, into `out`; striped over the session's lanes
    /// as [`Session::htod_socket`].
    pub(super) fn dtoh_socket(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        out: &mut [u8],
    ) -> CuResult<()> {
        self.dtoh_socket_as(DtohProc::Legacy, ctx, stream, src, out)
    }

    /// `cuMemcpyDtoHAsync` into pageable memory `out`, as the driver runs it: in `stream`'s
    /// order, returning once the copy has completed (`RM_MEMCPY_DTOH_STREAM`, revision 17),
    /// pipelined and striped as a synchronous copy is. `None` when this session does not
    /// copy so (shared memory, whose data area carries such copies; a server older than
    /// revision 17; a copy under 8 MiB (`STREAM_DTOH_MIN`), which a later synchronizing
    /// reply carries in one round trip): the caller issues the asynchronous copy.
    pub fn memcpy_dtoh_pageable(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        out: &mut [u8],
    ) -> Option<CuResult<()>> {
        if self.area.is_some()
            || self.welcome.revision < 17
            || out.len() < STREAM_DTOH_MIN
            || !stream_dtoh_enabled()
        {
            return None;
        }
        let mark = self.copy_mark();
        Some(
            self.dtoh_socket_as(DtohProc::Stream, ctx, stream, src, out)
                .and_then(|()| self.settle_stream(ctx, stream, mark)),
        )
    }

    fn dtoh_socket_as(
        &self,
        how: DtohProc,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        out: &mut [u8],
    ) -> CuResult<()> {
        let total = out.len();
        self.coherent(how.name(), || {
            let parts: Vec<(u64, &mut [u8])> = if out.is_empty() {
                vec![(src, &mut out[..])]
            } else {
                out.chunks_mut(SOCKET_CHUNK)
                    .enumerate()
                    .map(|(i, part)| (src + (i * SOCKET_CHUNK) as u64, part))
                    .collect()
            };
            self.striped(total, parts, |rpc, parts| {
                self.dtoh_chunks(how, rpc, ctx, stream, parts)
            })
        })
    }

    /// Reads `parts` (device address, where its bytes go) with synchronous `RM_MEMCPY_DTOH`
    /// calls on `rpc`, [`SOCKET_WINDOW`] in flight. The first error.
    ///
    /// With two parts or more, each reply's bytes are copied to their place on a thread of its
    /// own while this one reads the next reply from the socket: copying a 4 MiB chunk out
    /// takes about half as long as receiving it, and done here it held the next reply in the
    /// socket meanwhile.
    fn dtoh_chunks<'p>(
        &self,
        how: DtohProc,
        rpc: &remora_oncrpc::Client,
        ctx: RmHandle,
        stream: RmHandle,
        parts: Vec<(u64, &'p mut [u8])>,
    ) -> FirstErr {
        let copy_out = |data: &[u8], part: &mut [u8]| {
            self.profiled_within(DTOH_COPY_ROW, || part.copy_from_slice(data));
        };
        if parts.len() < 2 {
            let mut here = |data: Bytes, part: &'p mut [u8]| copy_out(&data, part);
            return self.dtoh_window(how, rpc, (ctx, stream), parts, &mut here);
        }
        std::thread::scope(|scope| {
            // One reply waiting for the copier at most: the reader's buffers stay few.
            let (tx, rx) = std::sync::mpsc::sync_channel::<(Bytes, &'p mut [u8])>(1);
            let copier = scope.spawn(move || {
                for (data, part) in rx {
                    copy_out(&data, part);
                }
            });
            let mut handed = move |data: Bytes, part: &'p mut [u8]| {
                if let Err(std::sync::mpsc::SendError((data, part))) = tx.send((data, part)) {
                    // The copier is gone (it panicked): copy here.
                    copy_out(&data, part);
                }
            };
            let r = self.dtoh_window(how, rpc, (ctx, stream), parts, &mut handed);
            drop(handed);
            if copier.join().is_err() {
                tracing::error!("remora: a device-to-host copy's copying thread panicked");
                return Some(CuError(cu::UNKNOWN));
            }
            r
        })
    }

    /// [`Session::dtoh_chunks`]'s calls: `deliver` puts each reply's bytes in their place.
    fn dtoh_window<'p>(
        &self,
        how: DtohProc,
        rpc: &remora_oncrpc::Client,
        (ctx, stream): (RmHandle, RmHandle),
        parts: Vec<(u64, &'p mut [u8])>,
        deliver: &mut dyn FnMut(Bytes, &'p mut [u8]),
    ) -> FirstErr {
        let name = how.name();
        let mut window: VecDeque<(PendingCall, &'p mut [u8])> = VecDeque::new();
        let mut first_err: FirstErr = None;
        let mut parts = parts.into_iter();
        loop {
            // Keep the window full while chunks remain and nothing failed.
            while window.len() < SOCKET_WINDOW && first_err.is_none() {
                let Some((addr, part)) = parts.next() else {
                    break;
                };
                let args = RmDtohArgs {
                    ctx,
                    stream,
                    src: addr,
                    size: part.len() as u64,
                    copy_id: 0,
                };
                match rpc.start_call(
                    REMORA_PROG,
                    REMORA_V1,
                    how.procedure(),
                    self.rpc.timeout(),
                    |enc| args.encode(enc),
                    &[],
                ) {
                    Ok(p) => window.push_back((p, part)),
                    Err(e) => {
                        first_err = Some(from_rpc(name, e));
                    }
                }
            }
            let Some((p, part)) = window.pop_front() else {
                break;
            };
            let len = part.len();
            let r = self
                .profiled_within(DTOH_WAIT_ROW, || p.finish(RmDtohReply::decode))
                .map_err(|e| from_rpc(name, e))
                .and_then(|r| {
                    self.finish_sync(RmSyncReply {
                        status: r.status,
                        copies: r.copies,
                    })?;
                    if r.data.len() != len {
                        tracing::error!("remora: DtoH of {len} bytes returned {}", r.data.len());
                        return Err(CuError(cu::UNKNOWN));
                    }
                    deliver(r.data, part);
                    Ok(())
                });
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        first_err
    }

    /// Runs a synchronous copy of `total` bytes in `parts` (chunks in address order) with
    /// `run` (which sends parts on one connection and answers the first error): on the
    /// session's own connection alone, or, for [`lanes::STRIPE_MIN`] bytes or more when the
    /// session has lanes, striped: the first chunk on the session's own connection, answered
    /// before anything else goes (so that the copy follows every earlier call of the session,
    /// as a synchronous copy must: the server has run them all when it answers), then the
    /// rest dealt round robin to the session's connection and its lanes, each on a thread of
    /// its own. Every connection's replies are taken; the first error (in chunk order of the
    /// connections) is the copy's.
    fn striped<P: Send>(
        &self,
        total: usize,
        parts: Vec<P>,
        run: impl Fn(&remora_oncrpc::Client, Vec<P>) -> FirstErr + Sync,
    ) -> CuResult<()> {
        let lanes = if total >= lanes::STRIPE_MIN {
            self.lanes()
        } else {
            &[]
        };
        self.striped_with(lanes, parts, run)
    }

    /// [`Session::striped`] over `lanes` (none: all on the session's own connection). `run`
    /// must answer only once the server has taken its parts in order (a synchronous copy's
    /// replies, or an asynchronous copy's NULL after its one-way chunks), since the first
    /// part's answer is what orders the rest after the session's earlier calls.
    fn striped_with<P: Send>(
        &self,
        lanes: &[RemoraV1Client],
        parts: Vec<P>,
        run: impl Fn(&remora_oncrpc::Client, Vec<P>) -> FirstErr + Sync,
    ) -> CuResult<()> {
        if lanes.is_empty() || parts.len() < 2 {
            return run(self.rpc.rpc(), parts).map_or(Ok(()), Err);
        }
        let mut parts = parts.into_iter();
        let first: Vec<P> = parts.by_ref().take(1).collect();
        if let Some(e) = run(self.rpc.rpc(), first) {
            return Err(e);
        }
        self.profiled_within(STRIPED_ROW, || self.striped_rest(lanes, parts, run))
    }

    /// [`Session::striped`] after its first chunk: the rest of `parts` dealt round robin to
    /// the session's connection and `lanes`, each on a thread of its own.
    fn striped_rest<P: Send>(
        &self,
        lanes: &[RemoraV1Client],
        parts: std::vec::IntoIter<P>,
        run: impl Fn(&remora_oncrpc::Client, Vec<P>) -> FirstErr + Sync,
    ) -> CuResult<()> {
        let n = lanes.len() + 1;
        let mut dealt: Vec<Vec<P>> = (0..n).map(|_| Vec::new()).collect();
        for (i, p) in parts.enumerate() {
            dealt[i % n].push(p);
        }
        let mut dealt = dealt.into_iter();
        let own = dealt.next().unwrap_or_default();
        let run = &run;
        let errs: Vec<FirstErr> = std::thread::scope(|scope| {
            let handles: Vec<_> = lanes
                .iter()
                .zip(dealt)
                .map(|(lane, parts)| scope.spawn(move || run(lane.rpc(), parts)))
                .collect();
            let mut errs = vec![run(self.rpc.rpc(), own)];
            for h in handles {
                errs.push(h.join().unwrap_or_else(|_| {
                    tracing::error!("remora: a lane's copy thread panicked");
                    Some(CuError(cu::UNKNOWN))
                }));
            }
            errs
        });
        errs.into_iter().flatten().next().map_or(Ok(()), Err)
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
