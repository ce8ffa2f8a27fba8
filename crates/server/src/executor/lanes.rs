//! Lanes (revision 16): more connections of one session, over which the client stripes bulk
//! copies (`remora.x`, REMORA_LANE_KEY / REMORA_LANE_ATTACH; docs/architecture.md).
//!
//! A session asks for its key; a new connection whose first call presents the key becomes a
//! lane: [`Executor::lane_main`] then names the session's own connection, and the service
//! runs the lane's copies as calls of that session (`RemoraService::dispatch`). The key's
//! secret is 16 random bytes, compared in constant time; its route is this process's id, so
//! that under process isolation the accepting process hands the lane to the worker that serves
//! the session. A lane ends with its connection; a session's key is forgotten when the
//! session ends, and a lane call after that closes the lane.

use remora_oncrpc::AuthStat;

use super::*;

/// The lanes of this executor's sessions.
#[derive(Default)]
pub(super) struct Lanes {
    /// Each session's key secret, by the session's connection.
    keys: rustc_hash::FxHashMap<u64, [u8; REMORA_LANE_SECRET as usize]>,
    /// Each lane's session, by the lane's connection.
    attached: rustc_hash::FxHashMap<u64, u64>,
}

impl Lanes {
    fn count(&self, main: u64) -> usize {
        self.attached.values().filter(|m| **m == main).count()
    }
}

/// A lane key's route: the process that serves the session.
fn route() -> u64 {
    u64::from(std::process::id())
}

impl Executor {
    fn lanes(&self) -> MutexGuard<'_, Lanes> {
        self.inner
            .lanes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The session connection that `connection` is a lane of, if it is one.
    pub(crate) fn lane_main(&self, connection: u64) -> Option<u64> {
        if self
            .inner
            .live_lanes
            .load(std::sync::atomic::Ordering::Acquire)
            == 0
        {
            return None;
        }
        self.lanes().attached.get(&connection).copied()
    }

    /// Whether the session of `connection` is still served.
    pub(crate) fn has_session(&self, connection: u64) -> bool {
        self.inner.sessions().contains_key(&connection)
    }

    /// REMORA_LANE_KEY: the key of the calling session (made at its first ask).
    pub(super) fn lane_key(&self, call: &CallContext) -> LaneKeyReply {
        let connection = call.connection;
        if !self.has_session(connection) || self.lane_main(connection).is_some() {
            // No session on this connection (no HELLO yet, or a lane's own).
            return LaneKeyReply::Default {
                discriminant: cu::NOT_INITIALIZED,
            };
        }
        let mut lanes = self.lanes();
        let secret = match lanes.keys.get(&connection) {
            Some(s) => *s,
            None => {
                let mut s = [0u8; REMORA_LANE_SECRET as usize];
                if let Err(e) =
                    rustix::rand::getrandom(&mut s, rustix::rand::GetRandomFlags::empty())
                        .map_err(std::io::Error::from)
                        .and_then(|n| {
                            (n == s.len())
                                .then_some(())
                                .ok_or_else(|| std::io::Error::other("short read"))
                        })
                {
                    tracing::error!(error = %e, "cannot make a lane key (getrandom); the session copies over its own connection");
                    return LaneKeyReply::Default {
                        discriminant: cu::OPERATING_SYSTEM,
                    };
                }
                lanes.keys.insert(connection, s);
                s
            }
        };
        LaneKeyReply::Case0(LaneKey {
            route: route(),
            secret,
        })
    }

    /// REMORA_LANE_ATTACH: makes the calling connection a lane of the session whose key it
    /// presents; anything else is refused as a wrong credential and the connection closed.
    pub(super) fn lane_attach(&self, call: &CallContext, key: LaneKey) -> ProcResult<CuResult_> {
        let connection = call.connection;
        let refuse = |why: &str| {
            remora_oncrpc::audit!(warn, "auth_failed", peer = %call.peer, connection,
                "lane refused: {why}; AUTH_ERROR (AUTH_BADCRED), connection closed");
            Err(ProcError::Denied(AuthStat::BadCred))
        };
        if self.has_session(connection) {
            return refuse("the connection already has a session of its own");
        }
        let mut lanes = self.lanes();
        if lanes.attached.contains_key(&connection) {
            return refuse("the connection is a lane already");
        }
        // Every key is compared, each in constant time.
        let mut found = None;
        for (main, secret) in &lanes.keys {
            if remora_proto::token::tokens_equal(secret, &key.secret) {
                found = Some(*main);
            }
        }
        let Some(main) = found.filter(|_| key.route == route()) else {
            return refuse("the key names no session of this server");
        };
        if lanes.count(main) >= REMORA_MAX_LANES as usize {
            return refuse(&format!(
                "the session has {REMORA_MAX_LANES} lanes already (REMORA_MAX_LANES)"
            ));
        }
        let Some(session) = self.inner.sessions().get(&main).cloned() else {
            return refuse("the key's session has ended");
        };
        // The lane is the session's tenant's: its copies pass the same checks. A lane that
        // authenticated otherwise (its own client certificate) must be of the same tenant.
        if let Some(tenant) = session.tenant.get() {
            match call.tenant() {
                Some(own) if own != tenant => {
                    return refuse(&format!(
                        "the lane's client certificate names tenant {own}, its session's tenant is {tenant}"
                    ));
                }
                Some(_) => {}
                None => {
                    call.authenticate(tenant);
                }
            }
        }
        lanes.attached.insert(connection, main);
        self.inner
            .live_lanes
            .fetch_add(1, std::sync::atomic::Ordering::Release);
        session.lanes_changed(lanes.count(main));
        tracing::debug!(
            connection,
            session = main,
            lanes = lanes.count(main),
            "lane attached"
        );
        Ok(0)
    }

    /// Forgets `connection` as a lane, or, for a session, its key: no lane attaches to it any
    /// more, and its lanes stay known as lanes of an ended session (each is closed at its
    /// next call) until their own connections end.
    pub(super) fn forget_lanes(&self, connection: u64) {
        let mut lanes = self.lanes();
        if let Some(main) = lanes.attached.remove(&connection) {
            self.inner
                .live_lanes
                .fetch_sub(1, std::sync::atomic::Ordering::Release);
            if let Some(session) = self.inner.sessions().get(&main) {
                session.lanes_changed(lanes.count(main));
            }
        }
        lanes.keys.remove(&connection);
    }
}
