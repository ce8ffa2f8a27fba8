//! Limits per session and per tenant (issue 13 §2): device memory, page-locked host memory,
//! bytes in flight, streams, events, modules and a tenant's sessions.
//!
//! The limits come from `remora serve --tenants tenants.toml` and `--limit KEY=VALUE`
//! ([`QuotaConfig`]); safe defaults apply to what neither names. What sessions use is kept in
//! a [`Ledger`]: one slot per session in a shared memory mapping, so that a tenant's sessions
//! in separate worker processes (process isolation) are counted together. A slot holds the
//! session's tenant (as a 64-bit key) and its use of each [`Kind`]; a tenant's use is the sum
//! over the slots with its key. A charge first adds to the session's own slot, then checks
//! the session's and the tenant's sums and takes the charge back when either is past its limit:
//! with sequentially consistent atomics two sessions charging at once can both be refused, but
//! never both pass a limit. The accepting process claims a slot for each worker it starts and
//! clears it when the worker ends, so a crashed worker's use is never left behind.
//!
//! A charge past a limit is the session's error only: [`SessionQuota::charge`] answers
//! `CUDA_ERROR_OUT_OF_MEMORY` (as the driver does when it cannot make the object) and logs
//! one `remora::audit` line naming the limit; nothing else changes.

use std::collections::BTreeMap;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use remora_proto::cuda::{CuError, CuResult, cu};

/// What is limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Bytes of device memory allocated (`cuMemAlloc`, pitched, stream-ordered and
    /// `cuMemCreate` allocations).
    DeviceMemory,
    /// Bytes of host memory the server page-locks for the session: its shared-memory data
    /// area (once registered) and the staging of asynchronous device-to-host copies.
    PinnedMemory,
    /// Bytes in flight: asynchronous device-to-host copies staged and not yet delivered.
    InFlight,
    /// Streams created.
    Streams,
    /// Events created.
    Events,
    /// Modules loaded.
    Modules,
    /// Sessions (client connections past HELLO) of a tenant; a session is always 1 of its own.
    Sessions,
}

/// Number of [`Kind`]s.
pub const KINDS: usize = 7;

impl Kind {
    /// Every kind, in the ledger's order.
    pub const ALL: [Kind; KINDS] = [
        Kind::DeviceMemory,
        Kind::PinnedMemory,
        Kind::InFlight,
        Kind::Streams,
        Kind::Events,
        Kind::Modules,
        Kind::Sessions,
    ];

    /// The key in `tenants.toml` and `--limit`.
    pub fn key(self) -> &'static str {
        match self {
            Kind::DeviceMemory => "device-memory",
            Kind::PinnedMemory => "pinned-memory",
            Kind::InFlight => "in-flight",
            Kind::Streams => "streams",
            Kind::Events => "events",
            Kind::Modules => "modules",
            Kind::Sessions => "sessions",
        }
    }

    /// Whether the kind counts bytes (written with a unit) rather than objects.
    pub fn is_bytes(self) -> bool {
        matches!(
            self,
            Kind::DeviceMemory | Kind::PinnedMemory | Kind::InFlight
        )
    }

    pub(crate) fn index(self) -> usize {
        Kind::ALL.iter().position(|k| *k == self).unwrap_or(0)
    }

    fn from_key(key: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.key() == key)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.key())
    }
}

/// A limit for each [`Kind`]; `None`: unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits([Option<u64>; KINDS]);

impl Limits {
    /// The limit of `kind`.
    pub fn get(&self, kind: Kind) -> Option<u64> {
        self.0[kind.index()]
    }

    /// Sets the limit of `kind`.
    pub fn set(&mut self, kind: Kind, value: Option<u64>) {
        self.0[kind.index()] = value;
    }

    /// `self` with every limit `over` names replaced by `over`'s.
    fn overlaid(mut self, over: &Overrides) -> Limits {
        for (kind, value) in &over.0 {
            self.set(*kind, *value);
        }
        self
    }
}

/// Limits one table of the file or one `--limit` sets (a value of `"unlimited"` is `None`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Overrides(Vec<(Kind, Option<u64>)>);

/// The limits of every tenant and session (`--tenants FILE`, `--limit KEY=VALUE`).
///
/// `tenants.toml`:
///
/// ```toml
/// # Every tenant as a whole (all its sessions together), unless its own table says otherwise.
/// [tenant]
/// device-memory = "64GiB"
/// sessions = 16
///
/// # Each session.
/// [session]
/// device-memory = "32GiB"
/// streams = 1024
///
/// # One tenant (the name its token or certificate gives; without authentication, "uid:N"
/// # for a local user, "anonymous" for TCP clients).
/// [tenants.alice]
/// device-memory = "20GiB"
/// [tenants.alice.session]
/// events = 4096
///
/// # A tenant's share of each GPU's SMs, in percent (1 to 100), enforced through MPS when the
/// # server runs with `--gpu-share mps`; in [tenant] it is every tenant's.
/// [tenants.bob]
/// gpu-share = 50
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaConfig {
    tenant: Limits,
    session: Limits,
    tenants: BTreeMap<String, (Overrides, Overrides)>,
    /// Every tenant's GPU share (`[tenant] gpu-share`, `--limit tenant.gpu-share`); 100: whole.
    share: GpuShare,
    /// Shares of named tenants (`[tenants.NAME] gpu-share`).
    shares: BTreeMap<String, GpuShare>,
    /// Unix users and the tenant each stands for (`--tenant-map`), for Unix-socket peers that
    /// did not authenticate otherwise.
    uids: BTreeMap<u32, String>,
}

/// Default limits: none on memory (one tenant may use the whole GPU, as locally), bounds on
/// what a runaway or hostile client could otherwise create without end.
impl Default for QuotaConfig {
    fn default() -> Self {
        // A session's bytes in flight are bounded by --max-pending-copy-bytes already.
        let mut session = Limits::default();
        session.set(Kind::Streams, Some(DEFAULT_STREAMS));
        session.set(Kind::Events, Some(DEFAULT_EVENTS));
        session.set(Kind::Modules, Some(DEFAULT_MODULES));
        let mut tenant = Limits::default();
        tenant.set(Kind::Sessions, Some(DEFAULT_TENANT_SESSIONS));
        Self {
            tenant,
            session,
            tenants: BTreeMap::new(),
            share: GpuShare::WHOLE,
            shares: BTreeMap::new(),
            uids: BTreeMap::new(),
        }
    }
}

/// A tenant's share of a GPU's SMs in percent, 1 to 100 (`gpu-share`): the MPS active
/// thread percentage of its sessions' worker processes under `remora serve --gpu-share mps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct GpuShare(u8);

impl GpuShare {
    /// The whole GPU: no limit.
    pub const WHOLE: GpuShare = GpuShare(100);
    /// The key in `tenants.toml` and `--limit`.
    pub const KEY: &'static str = "gpu-share";

    /// The share in percent.
    pub fn percent(self) -> u8 {
        self.0
    }

    /// Whether this is less than the whole GPU.
    pub fn is_limited(self) -> bool {
        self.0 < 100
    }

    /// Parses `50`, `50%` or `unlimited` (100).
    fn parse(s: &str) -> Result<GpuShare, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("unlimited") {
            return Ok(GpuShare::WHOLE);
        }
        let n: u64 = s
            .strip_suffix('%')
            .unwrap_or(s)
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a percentage from 1 to 100"))?;
        Self::from_percent(n)
    }

    fn from_percent(n: u64) -> Result<GpuShare, String> {
        match u8::try_from(n) {
            Ok(p @ 1..=100) => Ok(GpuShare(p)),
            _ => Err(format!(
                "{n} is not a percentage from 1 to 100 (a share of the GPU's SMs)"
            )),
        }
    }

    /// Reads a `gpu-share` value of a TOML table.
    fn from_toml(v: &toml::Value, table: &str) -> Result<GpuShare, QuotaError> {
        let r = match v {
            toml::Value::Integer(n) if *n >= 0 => Self::from_percent(*n as u64),
            toml::Value::String(s) => Self::parse(s),
            _ => Err("expected a percentage such as 50".into()),
        };
        r.map_err(|e| QuotaError(format!("{table} {}: {e}", Self::KEY)))
    }
}

impl fmt::Display for GpuShare {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}%", self.0)
    }
}

/// Default streams per session (PyTorch makes a few dozen per device).
pub const DEFAULT_STREAMS: u64 = 16_384;
/// Default events per session.
pub const DEFAULT_EVENTS: u64 = 1 << 18;
/// Default modules per session (a program with CUDA libraries loads a few thousand at most).
pub const DEFAULT_MODULES: u64 = 65_536;
/// Default sessions per tenant.
pub const DEFAULT_TENANT_SESSIONS: u64 = 256;

/// Why a limits file or `--limit` could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct QuotaError(String);

impl QuotaConfig {
    /// Reads `path` (TOML) over the defaults.
    pub fn load(path: &Path) -> Result<Self, QuotaError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            QuotaError(format!(
                "cannot read the tenants file {}: {e}",
                path.display()
            ))
        })?;
        let mut config = Self::default();
        config
            .apply_toml(&text)
            .map_err(|e| QuotaError(format!("tenants file {}: {}", path.display(), e.0)))?;
        Ok(config)
    }

    /// Applies the tables of a `tenants.toml` text.
    pub fn apply_toml(&mut self, text: &str) -> Result<(), QuotaError> {
        let table: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| QuotaError(e.message().trim().to_owned()))?;
        for (key, value) in &table {
            match key.as_str() {
                "tenant" => {
                    let (o, share) = tenant_table(value, "[tenant]")?;
                    self.tenant = self.tenant.overlaid(&o);
                    if let Some(share) = share {
                        self.share = share;
                    }
                }
                "session" => {
                    let o = overrides(value, "[session]", false)?;
                    self.session = self.session.overlaid(&o);
                }
                "tenants" => {
                    let Some(tenants) = value.as_table() else {
                        return Err(QuotaError(
                            "`tenants` must be tables: [tenants.NAME]".into(),
                        ));
                    };
                    for (name, t) in tenants {
                        let Some(t) = t.as_table() else {
                            return Err(QuotaError(format!(
                                "[tenants.{name}] must be a table of limits"
                            )));
                        };
                        let mut own = t.clone();
                        let session = match own.remove("session") {
                            Some(s) => overrides(&s, &format!("[tenants.{name}.session]"), false)?,
                            None => Overrides::default(),
                        };
                        let (tenant, share) =
                            tenant_table(&toml::Value::Table(own), &format!("[tenants.{name}]"))?;
                        if let Some(share) = share {
                            self.shares.insert(name.clone(), share);
                        }
                        self.tenants.insert(name.clone(), (tenant, session));
                    }
                }
                other => {
                    return Err(QuotaError(format!(
                        "unknown table `{other}`: expected [tenant], [session] or [tenants.NAME]"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Applies one `--limit` (`tenant.KEY=VALUE` or `session.KEY=VALUE`, e.g.
    /// `session.device-memory=8GiB`, `tenant.sessions=4`, `session.streams=unlimited`): a
    /// default for every tenant or session, over the file's `[tenant]`/`[session]`.
    pub fn apply_cli(&mut self, spec: &str) -> Result<(), QuotaError> {
        let bad = |why: &str| {
            QuotaError(format!(
                "--limit {spec:?}: {why}; expected tenant.KEY=VALUE or session.KEY=VALUE with KEY one of {}",
                keys()
            ))
        };
        let (name, value) = spec.split_once('=').ok_or_else(|| bad("no `=`"))?;
        let (level, key) = name.trim().split_once('.').ok_or_else(|| bad("no level"))?;
        if key == GpuShare::KEY {
            if level != "tenant" {
                return Err(bad("`gpu-share` is a tenant's share: use tenant.gpu-share"));
            }
            self.share = GpuShare::parse(value).map_err(|e| bad(&e))?;
            return Ok(());
        }
        let kind = Kind::from_key(key).ok_or_else(|| bad("unknown key"))?;
        let value = parse_value(kind, value.trim()).map_err(|e| bad(&e))?;
        match level {
            "tenant" => self.tenant.set(kind, value),
            "session" if kind == Kind::Sessions => {
                return Err(bad("`sessions` is a tenant limit"));
            }
            "session" => self.session.set(kind, value),
            _ => return Err(bad("the level must be `tenant` or `session`")),
        }
        Ok(())
    }

    /// `tenant`'s share of each GPU (`gpu-share`; [`GpuShare::WHOLE`] when none is set).
    pub fn gpu_share_of(&self, tenant: &str) -> GpuShare {
        self.shares.get(tenant).copied().unwrap_or(self.share)
    }

    /// A tenant whose share is less than the whole GPU, if any (every tenant's when
    /// `[tenant]` or `--limit` sets one).
    pub fn limited_share(&self) -> Option<(String, GpuShare)> {
        if self.share.is_limited() {
            return Some(("every tenant".into(), self.share));
        }
        self.shares
            .iter()
            .find(|(_, s)| s.is_limited())
            .map(|(t, s)| (format!("tenant {t}"), *s))
    }

    /// The limits of `tenant` as a whole and of each of its sessions.
    pub fn limits_of(&self, tenant: &str) -> (Limits, Limits) {
        match self.tenants.get(tenant) {
            Some((t, s)) => (self.tenant.overlaid(t), self.session.overlaid(s)),
            None => (self.tenant, self.session),
        }
    }

    /// Reads a tenant map: lines `UID TENANT` (blank lines and `#` comments allowed): a Unix
    /// socket peer of that user who presents no token or certificate is that tenant.
    pub fn load_tenant_map(&mut self, path: &Path) -> Result<(), QuotaError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            QuotaError(format!(
                "cannot read the tenant map {}: {e}",
                path.display()
            ))
        })?;
        self.apply_tenant_map(&text)
            .map_err(|e| QuotaError(format!("tenant map {}: {}", path.display(), e.0)))
    }

    /// Applies the lines of a tenant map ([`QuotaConfig::load_tenant_map`]).
    pub fn apply_tenant_map(&mut self, text: &str) -> Result<(), QuotaError> {
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad =
                |why: &str| QuotaError(format!("line {}: {why}; expected `UID TENANT`", n + 1));
            let mut words = line.split_whitespace();
            let (Some(uid), Some(tenant), None) = (words.next(), words.next(), words.next()) else {
                return Err(bad("not two words"));
            };
            let uid: u32 = uid.parse().map_err(|_| bad("the uid is not a number"))?;
            if let Some(problem) = remora_oncrpc::tls::tenant_name_problem(tenant) {
                return Err(bad(&problem));
            }
            if self.uids.insert(uid, tenant.to_owned()).is_some() {
                return Err(bad("the uid is mapped twice"));
            }
        }
        Ok(())
    }

    /// The tenant Unix user `uid` stands for, if the tenant map names it.
    pub fn tenant_of_uid(&self, uid: u32) -> Option<&str> {
        self.uids.get(&uid).map(String::as_str)
    }

    /// The tenant a connection counts as: the one it authenticated as (token or client
    /// certificate); without authentication the tenant the tenant map names for its Unix
    /// user (from SO_PEERCRED), else `uid:N`, or, over TCP, `anonymous`.
    pub fn tenant_of(&self, authenticated: Option<&str>, peer: &remora_oncrpc::Peer) -> String {
        if let Some(t) = authenticated {
            return t.to_owned();
        }
        match peer {
            remora_oncrpc::Peer::Unix { uid, .. } => self
                .tenant_of_uid(*uid)
                .map_or_else(|| format!("uid:{uid}"), str::to_owned),
            _ => "anonymous".to_owned(),
        }
    }

    /// The tenants the file names.
    pub fn named_tenants(&self) -> impl Iterator<Item = &str> {
        self.tenants.keys().map(String::as_str)
    }
}

fn keys() -> String {
    Kind::ALL
        .iter()
        .map(|k| k.key())
        .chain([GpuShare::KEY])
        .collect::<Vec<_>>()
        .join(", ")
}

/// The limits of a tenant's table (`[tenant]`, `[tenants.NAME]`) and its `gpu-share`.
fn tenant_table(
    value: &toml::Value,
    table: &str,
) -> Result<(Overrides, Option<GpuShare>), QuotaError> {
    let Some(t) = value.as_table() else {
        return Err(QuotaError(format!("{table} must be a table of limits")));
    };
    let mut t = t.clone();
    let share = t
        .remove(GpuShare::KEY)
        .map(|v| GpuShare::from_toml(&v, table))
        .transpose()?;
    Ok((overrides(&toml::Value::Table(t), table, true)?, share))
}

fn overrides(value: &toml::Value, table: &str, tenant: bool) -> Result<Overrides, QuotaError> {
    let Some(t) = value.as_table() else {
        return Err(QuotaError(format!("{table} must be a table of limits")));
    };
    let mut out = Overrides::default();
    for (key, v) in t {
        if key == GpuShare::KEY {
            return Err(QuotaError(format!(
                "{table}: `{key}` is a tenant's share of the GPU, not a session's: put it in [tenant] or [tenants.NAME]"
            )));
        }
        let kind = Kind::from_key(key).ok_or_else(|| {
            QuotaError(format!("{table}: unknown key `{key}`; keys are {}", keys()))
        })?;
        if kind == Kind::Sessions && !tenant {
            return Err(QuotaError(format!(
                "{table}: `sessions` is a limit of a tenant, not of a session"
            )));
        }
        let value = match v {
            toml::Value::Integer(n) if *n >= 0 => Some(*n as u64),
            toml::Value::String(s) => {
                parse_value(kind, s).map_err(|e| QuotaError(format!("{table} {key}: {e}")))?
            }
            _ => {
                return Err(QuotaError(format!(
                    "{table} {key}: expected a number, a size such as \"8GiB\", or \"unlimited\""
                )));
            }
        };
        out.0.push((kind, value));
    }
    Ok(out)
}

fn parse_value(kind: Kind, s: &str) -> Result<Option<u64>, String> {
    if s.eq_ignore_ascii_case("unlimited") {
        return Ok(None);
    }
    if kind.is_bytes() {
        parse_size(s).map(Some)
    } else {
        s.parse::<u64>()
            .map(Some)
            .map_err(|_| format!("{s:?} is not a count or \"unlimited\""))
    }
}

/// Parses a byte size: a number with an optional unit (`K`, `M`, `G`, `T`, with or without
/// `iB`/`B`; powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(digits);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?} is not a size such as 8GiB"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("{s:?}: unknown unit (use K, M, G or T, e.g. 8GiB)")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Renders a limit value for messages.
fn show(kind: Kind, value: u64) -> String {
    if kind.is_bytes() {
        let mut v = value as f64;
        for unit in ["B", "KiB", "MiB", "GiB", "TiB"] {
            if v < 1024.0 || unit == "TiB" {
                return if unit == "B" {
                    format!("{value} B")
                } else {
                    format!("{v:.1} {unit}")
                };
            }
            v /= 1024.0;
        }
    }
    value.to_string()
}

/// One session's use, in the shared mapping.
#[repr(C)]
struct Slot {
    /// 0: free; [`CLAIMED`]: a worker was given the slot, no session yet; else the tenant's key.
    tenant: AtomicU64,
    used: [AtomicU64; KINDS],
    /// Charges refused, by kind (for metrics: folded into the ledger's retired counts when
    /// the slot is cleared).
    hits: [AtomicU64; KINDS],
    /// The tenant's name, for status and metrics: a length byte, then up to
    /// [`MAX_NAME`] bytes, written before `tenant`.
    name: [AtomicU64; NAME_WORDS],
}

/// Words of [`Slot::name`].
const NAME_WORDS: usize = 8;
/// Longest tenant name a slot keeps (longer ones are cut, for display only).
const MAX_NAME: usize = NAME_WORDS * 8 - 1;

/// A tenant's use and refused charges, for `--metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantReport {
    /// Use of each kind ([`Kind::ALL`] order) over the tenant's live sessions.
    pub used: [u64; KINDS],
    /// Charges refused, by kind, since the server started.
    pub hits: [u64; KINDS],
}

/// [`Slot::tenant`] of a slot given to a worker that has not started its session.
const CLAIMED: u64 = 1;

/// What every session uses, in a shared mapping (a memfd) that session workers map too.
pub struct Ledger {
    fd: OwnedFd,
    base: *mut Slot,
    slots: usize,
    /// Refused charges of slots this process cleared, by tenant name (this process's own:
    /// the accepting server clears workers' slots, so it has them all).
    retired: std::sync::Mutex<BTreeMap<String, [u64; KINDS]>>,
}

// SAFETY: the mapping is only reached through the atomics of its slots, which are Sync; the
// pointer stays valid until `Drop` unmaps it, and nothing hands out references that outlive
// the Ledger.
unsafe impl Send for Ledger {}
// SAFETY: as above: shared access is through atomics only.
unsafe impl Sync for Ledger {}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger")
            .field("slots", &self.slots)
            .finish()
    }
}

/// Most slots a ledger holds (64 bytes each).
const MAX_SLOTS: usize = 1 << 20;

impl Ledger {
    /// A new ledger of `slots` slots, all free. The memfd is inheritable by processes this one
    /// starts ([`Ledger::fd`] names it to them).
    pub fn new(slots: usize) -> std::io::Result<Self> {
        let slots = slots.clamp(1, MAX_SLOTS);
        let fd = rustix::fs::memfd_create("remora-ledger", rustix::fs::MemfdFlags::empty())?;
        rustix::fs::ftruncate(&fd, (slots * std::mem::size_of::<Slot>()) as u64)?;
        Self::map(fd, slots)
    }

    /// The ledger a worker inherited as descriptor `fd` with `slots` slots.
    pub fn inherited(fd: i32, slots: usize) -> std::io::Result<Self> {
        if fd < 3 || slots == 0 || slots > MAX_SLOTS {
            return Err(std::io::Error::other("bad ledger descriptor or slot count"));
        }
        // SAFETY: the server passed this descriptor number for the ledger it created; this
        // process takes ownership of it here and nowhere else, and the size is checked
        // against the slots below before it is mapped.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let len = rustix::fs::fstat(&fd)?.st_size as usize;
        if len < slots * std::mem::size_of::<Slot>() {
            return Err(std::io::Error::other(
                "the ledger is smaller than its slot count",
            ));
        }
        Self::map(fd, slots)
    }

    fn map(fd: OwnedFd, slots: usize) -> std::io::Result<Self> {
        let len = slots * std::mem::size_of::<Slot>();
        // SAFETY: a fresh shared mapping of a file of at least `len` bytes at an address the
        // kernel chooses; it replaces nothing, and memfds cannot be truncated under us by
        // anyone but the server and its workers, which never shrink it.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                &fd,
                0,
            )?
        };
        Ok(Self {
            fd,
            base: base.cast(),
            slots,
            retired: std::sync::Mutex::default(),
        })
    }

    /// The descriptor to name to a worker (it is inherited across exec).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    fn slot(&self, i: usize) -> Option<&Slot> {
        // SAFETY: `i` is below `slots`, so the slot lies inside the mapping, which lives as
        // long as `self`; zeroed memory is a valid Slot (atomics of zero), and every access
        // goes through atomics.
        (i < self.slots).then(|| unsafe { &*self.base.add(i) })
    }

    /// Claims a free slot for a session (or for a worker that will start one).
    pub fn claim(&self) -> Option<usize> {
        (0..self.slots).find(|&i| {
            self.slot(i).is_some_and(|s| {
                s.tenant
                    .compare_exchange(0, CLAIMED, SeqCst, SeqCst)
                    .is_ok()
            })
        })
    }

    /// Clears slot `i` (its session ended, or its worker did): its use no longer counts.
    pub fn release(&self, i: usize) {
        if let Some(s) = self.slot(i) {
            if s.tenant.load(SeqCst) > CLAIMED && s.hits.iter().any(|h| h.load(SeqCst) > 0) {
                let mut retired = self
                    .retired
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let row = retired.entry(slot_name(s)).or_default();
                for (r, h) in row.iter_mut().zip(&s.hits) {
                    *r = r.saturating_add(h.swap(0, SeqCst));
                }
            }
            for h in &s.hits {
                h.store(0, SeqCst);
            }
            s.tenant.store(CLAIMED, SeqCst);
            for u in &s.used {
                u.store(0, SeqCst);
            }
            s.tenant.store(0, SeqCst);
        }
    }

    fn set_tenant(&self, i: usize, key: u64, name: &str) {
        if let Some(s) = self.slot(i) {
            let mut bytes = [0u8; NAME_WORDS * 8];
            let mut cut = name.len().min(MAX_NAME);
            while !name.is_char_boundary(cut) {
                cut -= 1;
            }
            bytes[0] = cut as u8;
            bytes[1..=cut].copy_from_slice(&name.as_bytes()[..cut]);
            for (w, chunk) in s.name.iter().zip(bytes.chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(chunk);
                w.store(u64::from_le_bytes(b), SeqCst);
            }
            s.tenant.store(key, SeqCst);
        }
    }

    /// What the sessions of tenant `key` use of `kind`, together.
    fn tenant_use(&self, key: u64, kind: Kind) -> u64 {
        (0..self.slots)
            .filter_map(|i| self.slot(i))
            .filter(|s| s.tenant.load(SeqCst) == key)
            .map(|s| s.used[kind.index()].load(SeqCst))
            .fold(0u64, u64::saturating_add)
    }

    /// What slot `i` uses of `kind`.
    fn session_use(&self, i: usize, kind: Kind) -> u64 {
        self.slot(i)
            .map_or(0, |s| s.used[kind.index()].load(SeqCst))
    }

    /// Every tenant with live sessions or refused charges: its use and refusals.
    pub fn report(&self) -> BTreeMap<String, TenantReport> {
        let mut out: BTreeMap<String, TenantReport> = self
            .retired
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(name, hits)| {
                (
                    name.clone(),
                    TenantReport {
                        used: [0; KINDS],
                        hits: *hits,
                    },
                )
            })
            .collect();
        for s in (0..self.slots).filter_map(|i| self.slot(i)) {
            if s.tenant.load(SeqCst) <= CLAIMED {
                continue;
            }
            let row = out.entry(slot_name(s)).or_default();
            for (k, u) in row.used.iter_mut().zip(&s.used) {
                *k = k.saturating_add(u.load(SeqCst));
            }
            for (k, h) in row.hits.iter_mut().zip(&s.hits) {
                *k = k.saturating_add(h.load(SeqCst));
            }
        }
        out
    }
}

/// The tenant name a slot holds (lossy: written by this server's own processes).
fn slot_name(s: &Slot) -> String {
    let mut bytes = Vec::with_capacity(NAME_WORDS * 8);
    for w in &s.name {
        bytes.extend_from_slice(&w.load(SeqCst).to_le_bytes());
    }
    let len = usize::from(bytes[0]).min(MAX_NAME);
    String::from_utf8_lossy(&bytes[1..=len]).into_owned()
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `map` made; no reference into it outlives self.
        let _ = unsafe {
            rustix::mm::munmap(self.base.cast(), self.slots * std::mem::size_of::<Slot>())
        };
    }
}

/// The ledger key of a tenant name (never 0 or [`CLAIMED`]). The hash is the same in every
/// process of one server (the same binary), which is all it needs.
fn tenant_key(tenant: &str) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default()
        .hash_one(tenant)
        .max(CLAIMED + 1)
}

/// What a session's charge ran into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitHit {
    /// The kind.
    pub kind: Kind,
    /// `"session"` or `"tenant"`.
    pub level: &'static str,
    /// The limit.
    pub limit: u64,
    /// What was in use before the charge.
    pub used: u64,
    /// The charge.
    pub asked: u64,
}

impl fmt::Display for LimitHit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "past the {} limit {}={} ({} in use, {} asked)",
            self.level,
            self.kind,
            show(self.kind, self.limit),
            show(self.kind, self.used),
            show(self.kind, self.asked)
        )
    }
}

/// One session's place in the [`Ledger`] and its limits.
pub struct SessionQuota {
    ledger: std::sync::Arc<Ledger>,
    slot: usize,
    tenant: String,
    key: u64,
    tenant_limits: Limits,
    session_limits: Limits,
    /// Whether this session released its slot itself at the end (thread isolation) or the
    /// process that gave it out does (a worker's slot).
    owns_slot: bool,
}

impl fmt::Debug for SessionQuota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionQuota")
            .field("slot", &self.slot)
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl SessionQuota {
    /// The session of `tenant` in `slot` (claimed already), counted as one of its tenant's
    /// sessions. Err: the tenant has all the sessions it may have; the slot is then released
    /// if `owns_slot`, and the session must be refused.
    pub fn start(
        ledger: std::sync::Arc<Ledger>,
        slot: usize,
        owns_slot: bool,
        tenant: &str,
        config: &QuotaConfig,
    ) -> Result<Self, LimitHit> {
        let (tenant_limits, session_limits) = config.limits_of(tenant);
        let key = tenant_key(tenant);
        ledger.set_tenant(slot, key, tenant);
        let q = Self {
            ledger,
            slot,
            tenant: tenant.to_owned(),
            key,
            tenant_limits,
            session_limits,
            owns_slot,
        };
        q.try_charge(Kind::Sessions, 1)?;
        Ok(q)
    }

    /// The tenant.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// Charges `n` of `kind`, or answers which limit it would pass (nothing charged then).
    pub fn try_charge(&self, kind: Kind, n: u64) -> Result<(), LimitHit> {
        let Some(slot) = self.ledger.slot(self.slot) else {
            return Ok(());
        };
        if n == 0 {
            return Ok(());
        }
        let cell = &slot.used[kind.index()];
        let before = cell.fetch_add(n, SeqCst);
        let after = before.saturating_add(n);
        let hit = if let Some(limit) = self.session_limits.get(kind)
            && after > limit
        {
            Some(LimitHit {
                kind,
                level: "session",
                limit,
                used: before,
                asked: n,
            })
        } else if let Some(limit) = self.tenant_limits.get(kind) {
            let total = self.ledger.tenant_use(self.key, kind);
            (total > limit).then(|| LimitHit {
                kind,
                level: "tenant",
                limit,
                used: total.saturating_sub(n),
                asked: n,
            })
        } else {
            None
        };
        match hit {
            Some(hit) => {
                self.uncharge(kind, n);
                slot.hits[kind.index()].fetch_add(1, SeqCst);
                Err(hit)
            }
            None => Ok(()),
        }
    }

    /// [`SessionQuota::try_charge`] for a CUDA call: past a limit, one audit line naming it
    /// and `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn charge(&self, kind: Kind, n: u64, what: &str) -> CuResult<()> {
        self.try_charge(kind, n).map_err(|hit| {
            remora_oncrpc::audit!(
                warn,
                limit "tenants",
                tenant = %self.tenant,
                kind = kind.key(),
                level = hit.level,
                "{what} refused: {hit}; CUDA_ERROR_OUT_OF_MEMORY (limits: remora serve --tenants / --limit)"
            );
            CuError(cu::OUT_OF_MEMORY)
        })
    }

    /// Adds `n` of `kind` without checking a limit (what was made beyond what was charged).
    pub fn add(&self, kind: Kind, n: u64) {
        if let Some(slot) = self.ledger.slot(self.slot) {
            slot.used[kind.index()].fetch_add(n, SeqCst);
        }
    }

    /// Takes back `n` of `kind` (an object freed, a copy delivered).
    pub fn uncharge(&self, kind: Kind, n: u64) {
        if let Some(slot) = self.ledger.slot(self.slot) {
            let _ =
                slot.used[kind.index()].fetch_update(SeqCst, SeqCst, |u| Some(u.saturating_sub(n)));
        }
    }

    /// What this session uses of `kind`.
    pub fn used(&self, kind: Kind) -> u64 {
        self.ledger.session_use(self.slot, kind)
    }

    /// What the session's tenant uses of `kind`, over all its sessions.
    pub fn tenant_used(&self, kind: Kind) -> u64 {
        self.ledger.tenant_use(self.key, kind)
    }
}

impl Drop for SessionQuota {
    fn drop(&mut self) {
        if self.owns_slot {
            self.ledger.release(self.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn config(text: &str) -> QuotaConfig {
        let mut c = QuotaConfig::default();
        c.apply_toml(text).unwrap();
        c
    }

    #[test]
    fn the_file_sets_defaults_and_tenant_overrides() {
        let c = config(
            r#"
            [tenant]
            device-memory = "64GiB"
            sessions = 16
            [session]
            device-memory = "32GiB"
            streams = 1024
            [tenants.alice]
            device-memory = "20GiB"
            [tenants.alice.session]
            events = 4096
            streams = "unlimited"
            "#,
        );
        let (t, s) = c.limits_of("bob");
        assert_eq!(t.get(Kind::DeviceMemory), Some(64 << 30));
        assert_eq!(t.get(Kind::Sessions), Some(16));
        assert_eq!(s.get(Kind::DeviceMemory), Some(32 << 30));
        assert_eq!(s.get(Kind::Streams), Some(1024));
        assert_eq!(s.get(Kind::Events), Some(DEFAULT_EVENTS));
        let (t, s) = c.limits_of("alice");
        assert_eq!(t.get(Kind::DeviceMemory), Some(20 << 30));
        assert_eq!(t.get(Kind::Sessions), Some(16));
        assert_eq!(s.get(Kind::Events), Some(4096));
        assert_eq!(s.get(Kind::Streams), None);
        assert_eq!(c.named_tenants().collect::<Vec<_>>(), ["alice"]);
    }

    #[test]
    fn mistakes_in_the_file_are_named() {
        let err = |t: &str| QuotaConfig::default().apply_toml(t).unwrap_err().0;
        assert!(err("[session]\nstreamz = 3").contains("unknown key `streamz`"));
        assert!(err("[session]\nsessions = 3").contains("limit of a tenant"));
        assert!(err("[tenant]\ndevice-memory = \"8 parsecs\"").contains("unknown unit"));
        assert!(err("[sessions]\nstreams = 1").contains("unknown table `sessions`"));
        assert!(err("[tenant]\nstreams = -1").contains("expected a number"));
        assert!(err("[tenant\n").contains("expected"));
    }

    #[test]
    fn cli_limits_override_the_file() {
        let mut c = config("[session]\nstreams = 5");
        c.apply_cli("session.streams=7").unwrap();
        c.apply_cli("tenant.device-memory = 1G").unwrap();
        let (t, s) = c.limits_of("x");
        assert_eq!(s.get(Kind::Streams), Some(7));
        assert_eq!(t.get(Kind::DeviceMemory), Some(1 << 30));
        for bad in [
            "streams=1",
            "session.sessions=1",
            "team.streams=1",
            "session.x=1",
        ] {
            assert!(c.apply_cli(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn gpu_shares_are_percentages_of_tenants_only() {
        let c = config(
            "[tenant]\ngpu-share = \"80%\"\ndevice-memory = \"2GiB\"\n\
             [tenants.bob]\ngpu-share = 50\n[tenants.carol]\ngpu-share = \"unlimited\"\n",
        );
        assert_eq!(c.gpu_share_of("bob").percent(), 50);
        assert_eq!(c.gpu_share_of("alice").percent(), 80);
        assert!(!c.gpu_share_of("carol").is_limited());
        assert_eq!(
            c.limits_of("alice").0.get(Kind::DeviceMemory),
            Some(2 << 30),
            "the share sits beside the tenant's limits"
        );
        assert_eq!(
            c.limited_share(),
            Some(("every tenant".into(), GpuShare(80)))
        );
        let mut d = QuotaConfig::default();
        assert_eq!(d.limited_share(), None);
        assert!(!d.gpu_share_of("anyone").is_limited());
        d.apply_cli("tenant.gpu-share=25").unwrap();
        assert_eq!(d.gpu_share_of("anyone").percent(), 25);
        let e = d.apply_cli("session.gpu-share=25").unwrap_err().0;
        assert!(e.contains("tenant.gpu-share"), "{e}");
        for (text, want) in [
            ("[tenant]\ngpu-share = 0\n", "percentage from 1 to 100"),
            ("[tenant]\ngpu-share = 101\n", "percentage from 1 to 100"),
            (
                "[tenants.x]\ngpu-share = \"half\"\n",
                "percentage from 1 to 100",
            ),
            ("[tenants.x]\ngpu-share = 1.5\n", "expected a percentage"),
            ("[session]\ngpu-share = 50\n", "not a session's"),
            ("[tenants.x.session]\ngpu-share = 50\n", "not a session's"),
        ] {
            let e = QuotaConfig::default().apply_toml(text).unwrap_err().0;
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn the_tenant_map_names_users_and_its_mistakes() {
        let mut c = QuotaConfig::default();
        c.apply_tenant_map("# users\n1000 alice\n\n1001  bob  # a comment\n")
            .unwrap();
        assert_eq!(c.tenant_of_uid(1000), Some("alice"));
        assert_eq!(c.tenant_of_uid(1001), Some("bob"));
        assert_eq!(c.tenant_of_uid(0), None);
        let err = |t: &str| QuotaConfig::default().apply_tenant_map(t).unwrap_err().0;
        assert!(err("x alice").contains("line 1: the uid is not a number"));
        assert!(err("1 a b").contains("not two words"));
        assert!(err("1 a\n1 b").contains("line 2: the uid is mapped twice"));
        assert!(err("1 al/ice").contains("line 1"));
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2t"), Ok(2 << 40));
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn a_tenant_is_limited_over_all_its_sessions() {
        let c =
            config("[tenant]\ndevice-memory = 100\nsessions = 2\n[session]\ndevice-memory = 70");
        let ledger = Arc::new(Ledger::new(8).unwrap());
        let start = |tenant: &str| {
            let slot = ledger.claim().unwrap();
            SessionQuota::start(Arc::clone(&ledger), slot, true, tenant, &c)
        };
        let a = start("t").unwrap();
        let b = start("t").unwrap();
        let other = start("u").unwrap();
        let third = start("t").unwrap_err();
        assert_eq!(
            (third.kind, third.level, third.limit),
            (Kind::Sessions, "tenant", 2)
        );
        // The session limit, then the tenant's.
        assert_eq!(
            a.try_charge(Kind::DeviceMemory, 71).unwrap_err().level,
            "session"
        );
        a.try_charge(Kind::DeviceMemory, 60).unwrap();
        let hit = b.try_charge(Kind::DeviceMemory, 50).unwrap_err();
        assert_eq!((hit.level, hit.used, hit.asked), ("tenant", 60, 50));
        b.try_charge(Kind::DeviceMemory, 40).unwrap();
        // Another tenant is not affected.
        other.try_charge(Kind::DeviceMemory, 70).unwrap();
        assert_eq!(a.tenant_used(Kind::DeviceMemory), 100);
        // Freeing makes room; a session's end frees all it held.
        a.uncharge(Kind::DeviceMemory, 10);
        b.try_charge(Kind::DeviceMemory, 10).unwrap();
        drop(a);
        assert_eq!(b.tenant_used(Kind::DeviceMemory), 50);
        assert_eq!(b.tenant_used(Kind::Sessions), 1);
        start("t").unwrap();
        assert_eq!(
            charge_error(&b),
            CuError(cu::OUT_OF_MEMORY),
            "charge answers OUT_OF_MEMORY"
        );
    }

    fn charge_error(q: &SessionQuota) -> CuError {
        q.charge(Kind::DeviceMemory, 1000, "test allocation")
            .unwrap_err()
    }

    #[test]
    fn racing_sessions_never_pass_a_tenant_limit_together() {
        let c = config("[tenant]\nstreams = 1000\nsessions = 64");
        let ledger = Arc::new(Ledger::new(64).unwrap());
        let quotas: Vec<_> = (0..8)
            .map(|_| {
                let slot = ledger.claim().unwrap();
                Arc::new(SessionQuota::start(Arc::clone(&ledger), slot, true, "t", &c).unwrap())
            })
            .collect();
        let granted: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = quotas
                .iter()
                .map(|q| {
                    s.spawn(move || {
                        (0..500)
                            .filter(|_| q.try_charge(Kind::Streams, 1).is_ok())
                            .count() as u64
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert!(granted <= 1000, "{granted} granted past a limit of 1000");
        assert!(granted >= 900, "only {granted} of 1000 granted");
        assert_eq!(quotas[0].tenant_used(Kind::Streams), granted);
    }

    fn q_hits(ledger: &Ledger) -> u64 {
        ledger
            .report()
            .values()
            .map(|r| r.hits.iter().sum::<u64>())
            .sum()
    }

    #[test]
    fn refusals_are_counted_per_tenant_and_outlive_their_sessions() {
        let c = config("[session]\nstreams = 1");
        let ledger = Arc::new(Ledger::new(4).unwrap());
        let slot = ledger.claim().unwrap();
        let q =
            SessionQuota::start(Arc::clone(&ledger), slot, true, "a-long-tenant-name", &c).unwrap();
        q.try_charge(Kind::Streams, 1).unwrap();
        q.try_charge(Kind::Streams, 1).unwrap_err();
        q.try_charge(Kind::Streams, 1).unwrap_err();
        let r = &ledger.report()["a-long-tenant-name"];
        assert_eq!(r.used[Kind::Streams.index()], 1);
        assert_eq!(r.used[Kind::Sessions.index()], 1);
        assert_eq!(r.hits[Kind::Streams.index()], 2);
        drop(q);
        let r = &ledger.report()["a-long-tenant-name"];
        assert_eq!(r.used, [0; KINDS], "the session ended");
        assert_eq!(r.hits[Kind::Streams.index()], 2, "refusals are kept");
        assert_eq!(q_hits(&ledger), 2);
    }

    #[test]
    fn a_worker_sees_the_servers_ledger() {
        let ledger = Ledger::new(4).unwrap();
        let slot = ledger.claim().unwrap();
        let fd = rustix::io::fcntl_dupfd_cloexec(ledger.fd(), 10).unwrap();
        let worker =
            Arc::new(Ledger::inherited(std::os::fd::IntoRawFd::into_raw_fd(fd), 4).unwrap());
        let q = SessionQuota::start(
            Arc::clone(&worker),
            slot,
            false,
            "t",
            &QuotaConfig::default(),
        )
        .unwrap();
        q.try_charge(Kind::Events, 3).unwrap();
        assert_eq!(ledger.report()["t"].used[Kind::Events.index()], 3);
        // The server clears the slot when the worker ends, whatever the worker did.
        drop(q);
        assert_eq!(
            ledger.report()["t"].used[Kind::Sessions.index()],
            1,
            "a worker's slot is the server's to clear"
        );
        ledger.release(slot);
        assert!(ledger.report().is_empty(), "nothing refused, nothing left");
        assert!(Ledger::inherited(1, 4).is_err());
    }
}
