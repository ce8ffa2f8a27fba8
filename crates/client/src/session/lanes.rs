//! Lanes (revision 16): more TCP connections of this session, over which synchronous bulk
//! copies are striped (`socket_copies.rs`), since one TCP stream is bounded by one core on
//! each side (on the H100 host, a plain loopback stream moves ~3.9 GB/s).
//!
//! They are opened when the first copy of [`STRIPE_MIN`] bytes or more needs them, for a
//! session on a socket with a server of revision 16 or later: the session asks for its key
//! (`REMORA_LANE_KEY`), then connects `REMORA_LANES` more times (default
//! [`DEFAULT_LANES`]; 0 turns lanes off) and presents it on each (`REMORA_LANE_ATTACH`).
//! A lane that cannot be opened is logged once and the session goes on with those it has
//! (none: copies use the session's own connection, as before). Sessions over `tls://` open
//! their lanes over TLS with the session's TLS settings (where encryption bounds a stream to
//! one core, lanes help most), sessions on a Unix socket (not in shared memory) over the
//! socket. Shared-memory sessions have none: their copies go through the data area.

use std::sync::OnceLock;
use std::time::Duration;

use remora_oncrpc::{Client as RpcClient, ClientConfig, Endpoint, Liveness, TransportChoice};

use super::*;

/// Copies of at least this many bytes are striped over the lanes.
pub(crate) const STRIPE_MIN: usize = 16 << 20;
/// Lanes a session opens unless `REMORA_LANES` says otherwise.
pub(crate) const DEFAULT_LANES: usize = 3;

/// A session's lanes: where to open them, and once opened, the connections.
pub(crate) struct Lanes {
    /// The server, when lanes may be opened (a `tcp://` server of revision 16 or later).
    endpoint: Option<Endpoint>,
    wanted: usize,
    connect_timeout: Duration,
    call_timeout: Duration,
    liveness: Option<Liveness>,
    tls: Option<std::sync::Arc<remora_oncrpc::ClientTls>>,
    open: OnceLock<Vec<RemoraV1Client>>,
}

impl Lanes {
    /// The lanes opened so far (none before the first striped copy).
    pub(crate) fn opened(&self) -> &[RemoraV1Client] {
        self.open.get().map_or(&[], Vec::as_slice)
    }

    /// The lanes a session with `endpoint` at `revision` may open (`shm`: the session is in
    /// shared memory, and opens none).
    pub(crate) fn new(
        endpoint: &Endpoint,
        revision: u32,
        shm: bool,
        config: &SessionConfig,
    ) -> Self {
        let wanted = match std::env::var("REMORA_LANES") {
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(n) => n.min(REMORA_MAX_LANES as usize),
                Err(_) => {
                    tracing::warn!(
                        "remora: REMORA_LANES={v:?} is not a number of connections (0 to {REMORA_MAX_LANES}); using {DEFAULT_LANES}"
                    );
                    DEFAULT_LANES
                }
            },
            Err(_) => DEFAULT_LANES,
        };
        Self {
            endpoint: (!shm && revision >= 16 && wanted > 0).then(|| endpoint.clone()),
            wanted,
            connect_timeout: config.connect_timeout,
            call_timeout: config.call_timeout,
            liveness: config.liveness,
            tls: config.tls.clone(),
            open: OnceLock::new(),
        }
    }
}

impl Session {
    /// How many lanes the session has open (none until a copy wants them).
    pub fn lane_count(&self) -> usize {
        self.lanes.open.get().map_or(0, Vec::len)
    }

    /// The session's lanes, opened at the first call that wants them (empty when it may have
    /// none, or none could be opened).
    pub(crate) fn lanes(&self) -> &[RemoraV1Client] {
        self.lanes.open.get_or_init(|| self.open_lanes())
    }

    fn open_lanes(&self) -> Vec<RemoraV1Client> {
        let l = &self.lanes;
        let Some(endpoint) = &l.endpoint else {
            return Vec::new();
        };
        let key = match self.rpc.remora_lane_key() {
            Ok(LaneKeyReply::Case0(key)) => key,
            Ok(LaneKeyReply::Default { discriminant }) => {
                tracing::warn!(
                    "remora: the server gave no lane key ({}); bulk copies use one connection",
                    remora_proto::cuda::CuError(discriminant)
                );
                return Vec::new();
            }
            Err(e) => {
                tracing::warn!(
                    "remora: cannot ask {endpoint} for a lane key ({e}); bulk copies use one connection"
                );
                return Vec::new();
            }
        };
        let mut lanes = Vec::new();
        for _ in 0..l.wanted {
            let config = ClientConfig {
                connect_timeout: Some(l.connect_timeout),
                default_timeout: l.call_timeout,
                max_record_size: MAX_REPLY_RECORD,
                // The socket alone: a lane never moves into shared memory.
                transport: match endpoint {
                    Endpoint::Unix(_) => TransportChoice::Unix,
                    Endpoint::Tcp(_) | Endpoint::Tls(_) => TransportChoice::Tcp,
                },
                liveness: l.liveness,
                tls: l.tls.clone(),
                ..ClientConfig::default()
            };
            let attached = RpcClient::connect_with(endpoint, config)
                .map(RemoraV1Client::new)
                .and_then(|lane| lane.remora_lane_attach(&key).map(|r| (lane, r)));
            match attached {
                Ok((lane, 0)) => lanes.push(lane),
                Ok((_, status)) => {
                    tracing::warn!(
                        "remora: {endpoint} refused a lane ({}); {} lane(s) open",
                        remora_proto::cuda::CuError(status),
                        lanes.len()
                    );
                    break;
                }
                Err(e) => {
                    tracing::warn!(
                        "remora: cannot open a lane to {endpoint} ({e}); {} lane(s) open",
                        lanes.len()
                    );
                    break;
                }
            }
        }
        tracing::debug!(lanes = lanes.len(), %endpoint, "remora: lanes for bulk copies open");
        lanes
    }
}
