//! The server-wide kernel image cache, keyed by SHA-256, bounded in bytes, least recently used
//! out first. Shared by every session, so a client that loads an image another client sent
//! sends only its hash.
//!
//! Entries are scoped (issue 13, module-cache privacy): an image is found only by clients of
//! the scope that uploaded it, its tenant (or, without authentication, its Unix user, or all
//! anonymous TCP clients together). Knowing an image's SHA-256 is therefore not enough to load
//! another tenant's module or to learn that it was uploaded. The key of an entry is
//! SHA-256(`remora-module-scope`, scope, image hash); the file holds the image, checked
//! against the image hash when read.
//!
//! Sessions in worker processes share it through a directory: one file per image, named by
//! the hex SHA-256, written to a temporary name and renamed (so readers never see a partial
//! file), checked against its hash when read, and bounded in total size by evicting the least
//! recently used files (by modification time, refreshed on every use). An in-memory cache,
//! bounded the same way, sits in front.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use remora_xdr::Bytes;
use sha2::{Digest, Sha256};

/// Default bound of the cache: 1 GiB.
pub const DEFAULT_CACHE_BYTES: u64 = 1 << 30;

#[derive(Default)]
struct State {
    map: HashMap<[u8; 32], (Bytes, u64)>,
    total: u64,
    tick: u64,
}

/// Work for the thread that writes the shared directory.
enum DiskJob {
    /// Write this image under this key.
    Put([u8; 32], Bytes),
    /// Answer once every earlier job is done.
    Flush(SyncSender<()>),
}

/// Images waiting for the directory writer; past this, `insert` writes them itself.
const DISK_QUEUE: usize = 64;

/// Kernel images by hash.
pub(crate) struct ModuleCache {
    capacity: u64,
    state: Mutex<State>,
    /// The directory shared with other processes, if any.
    dir: Option<PathBuf>,
    /// The thread that writes new images to `dir`, off the module load's path (writing and
    /// evicting took ~0.8 ms per image, 61 ms of PyTorch's start-up on the H100).
    writer: Option<SyncSender<DiskJob>>,
}

impl ModuleCache {
    #[cfg(test)]
    pub(crate) fn new(capacity: u64) -> Self {
        Self::with_dir(capacity, None)
    }

    /// A cache backed by `dir` (shared with other processes) when given.
    pub(crate) fn with_dir(capacity: u64, dir: Option<PathBuf>) -> Self {
        let writer = dir.clone().and_then(|dir| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<DiskJob>(DISK_QUEUE);
            let spawned = std::thread::Builder::new()
                .name("remora-module-cache".into())
                .spawn(move || {
                    // Ends when the cache, and with it the sender, is dropped.
                    for job in rx {
                        match job {
                            DiskJob::Put(key, image) => write_entry(&dir, &key, &image, capacity),
                            DiskJob::Flush(done) => {
                                let _ = done.send(());
                            }
                        }
                    }
                });
            match spawned {
                Ok(_) => Some(tx),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start the module cache's writer thread; images are written by the loading thread");
                    None
                }
            }
        });
        Self {
            capacity,
            state: Mutex::new(State::default()),
            dir,
            writer,
        }
    }

    /// Waits until every image handed to the directory writer so far is written.
    pub(crate) fn flush(&self) {
        if let Some(w) = &self.writer {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            if w.send(DiskJob::Flush(tx)).is_ok() {
                let _ = rx.recv();
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// The image with `hash` that scope `scope` uploaded, marking it recently used: from
    /// memory, else from the shared directory (checked against its hash).
    pub(crate) fn get(&self, scope: &str, hash: &[u8; 32]) -> Option<Bytes> {
        let key = scoped(scope, hash);
        if let Some(image) = self.get_memory(&key) {
            if let Some(dir) = &self.dir {
                touch(&dir.join(hex(&key)));
            }
            return Some(image);
        }
        let dir = self.dir.as_ref()?;
        let image = disk_get(dir, &key, hash, self.capacity)?;
        // Read from the file into memory of its own.
        self.insert_memory(key, &image, true);
        Some(image)
    }

    fn get_memory(&self, hash: &[u8; 32]) -> Option<Bytes> {
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        st.map.get_mut(hash).map(|(image, used)| {
            *used = tick;
            image.clone()
        })
    }

    /// Adds an image (whose hash the caller has verified), evicting the least recently used
    /// ones to stay within the bound. An image larger than the whole cache is not kept.
    pub(crate) fn insert(&self, scope: &str, hash: [u8; 32], image: Bytes) {
        self.insert_image(scope, hash, image, false);
    }

    /// [`ModuleCache::insert`] of an image already copied into memory of its own (not a view
    /// of a received record), which the cache keeps as it is.
    pub(crate) fn insert_own(&self, scope: &str, hash: [u8; 32], image: Bytes) {
        self.insert_image(scope, hash, image, true);
    }

    fn insert_image(&self, scope: &str, hash: [u8; 32], image: Bytes, own: bool) {
        if image.len() as u64 > self.capacity {
            return;
        }
        let key = scoped(scope, &hash);
        if let Some(dir) = &self.dir {
            // To the writer thread; when its queue is full (a burst of loads), written here.
            let queued = self
                .writer
                .as_ref()
                .is_some_and(|w| w.try_send(DiskJob::Put(key, image.clone())).is_ok());
            if !queued {
                write_entry(dir, &key, &image, self.capacity);
            }
        }
        self.insert_memory(key, &image, own);
    }

    /// Keeps `image` in memory under `hash`: as it is when it is `own` (memory of its own),
    /// else a copy of it.
    fn insert_memory(&self, hash: [u8; 32], image: &Bytes, own: bool) {
        let size = image.len() as u64;
        if size > self.capacity {
            return;
        }
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        if let Some((_, used)) = st.map.get_mut(&hash) {
            *used = tick;
            return;
        }
        while st.total + size > self.capacity {
            let Some(oldest) = st.map.iter().min_by_key(|(_, (_, t))| *t).map(|(h, _)| *h) else {
                break;
            };
            if let Some((old, _)) = st.map.remove(&oldest) {
                st.total -= old.len() as u64;
            }
        }
        st.total += size;
        // Keep a copy of its own, not a view that pins the whole received record.
        let image = if own {
            image.clone()
        } else {
            Bytes::copy_from_slice(image)
        };
        st.map.insert(hash, (image, tick));
    }
}

/// The cache key of image `hash` in scope `scope`.
fn scoped(scope: &str, hash: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"remora-module-scope\0");
    h.update((scope.len() as u64).to_le_bytes());
    h.update(scope.as_bytes());
    h.update(hash);
    h.finalize().into()
}

fn hex(hash: &[u8; 32]) -> String {
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

fn is_entry_name(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Opens cache entry `path` for reading (or for writing its times) only if it is a regular
/// file: never through a symbolic link, and without blocking on a FIFO or device that someone
/// put there.
fn open_entry(path: &Path, write: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::File::options()
        .read(!write)
        .write(write)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(file)
}

/// Marks an entry recently used.
fn touch(path: &Path) {
    if let Ok(f) = open_entry(path, true) {
        let _ = f.set_modified(SystemTime::now());
    }
}

/// The image with `hash` stored under `key` in `dir`, if there and intact (a file that does
/// not match its hash is removed).
fn disk_get(dir: &Path, key: &[u8; 32], hash: &[u8; 32], limit: u64) -> Option<Bytes> {
    use std::io::Read;
    let path = dir.join(hex(key));
    let file = open_entry(&path, false).ok()?;
    let size = file.metadata().ok()?.len();
    if size > limit {
        tracing::warn!(path = %path.display(), size, limit, "module cache file larger than the cache; ignored");
        return None;
    }
    let mut data = Vec::with_capacity(size as usize);
    file.take(limit).read_to_end(&mut data).ok()?;
    let digest: [u8; 32] = Sha256::digest(&data).into();
    if &digest != hash {
        tracing::warn!(path = %path.display(), "module cache file does not match its SHA-256; removed");
        let _ = std::fs::remove_file(&path);
        return None;
    }
    touch(&path);
    Some(Bytes::from(data))
}

/// [`disk_put`], a failure logged (the directory is a cache: the image stays in memory).
fn write_entry(dir: &Path, key: &[u8; 32], image: &[u8], capacity: u64) {
    if let Err(e) = disk_put(dir, key, image, capacity) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot write to the module cache directory");
    }
}

/// Writes the image to `dir` (temporary name, then rename), then evicts the least recently
/// used files beyond `capacity` bytes.
fn disk_put(dir: &Path, hash: &[u8; 32], image: &[u8], capacity: u64) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let name = hex(hash);
    let path = dir.join(&name);
    match std::fs::symlink_metadata(&path) {
        Ok(meta) if meta.is_file() => {
            touch(&path);
            return Ok(());
        }
        // Anything else under an entry's name (a link, a FIFO) is replaced by the rename below.
        _ => {}
    }
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let written = std::fs::File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(image))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    evict(dir, capacity, &path)
}

/// Removes the least recently used entries of `dir` until they total at most `capacity`
/// bytes, keeping `keep` (just written).
fn evict(dir: &Path, capacity: u64, keep: &Path) -> std::io::Result<()> {
    let mut entries = Vec::new();
    let mut total = 0u64;
    for entry in std::fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        if !entry.file_name().to_str().is_some_and(is_entry_name) {
            continue;
        }
        // DirEntry::metadata does not follow links: only regular files count and go.
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        total += meta.len();
        let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        entries.push((used, meta.len(), entry.path()));
    }
    entries.sort();
    for (_, size, path) in entries {
        if total <= capacity {
            break;
        }
        if path == keep {
            continue;
        }
        if std::fs::remove_file(&path).is_ok() {
            total -= size;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: &str = "tenant:a";

    #[test]
    fn evicts_least_recently_used_within_the_bound() {
        let c = ModuleCache::new(10);
        c.insert(S, [1; 32], Bytes::from_static(b"aaaa"));
        c.insert(S, [2; 32], Bytes::from_static(b"bbbb"));
        assert!(c.get(S, &[1; 32]).is_some());
        c.insert(S, [3; 32], Bytes::from_static(b"cccc"));
        assert!(c.get(S, &[2; 32]).is_none(), "2 was least recently used");
        assert!(c.get(S, &[1; 32]).is_some() && c.get(S, &[3; 32]).is_some());
        c.insert(S, [4; 32], Bytes::from(vec![0u8; 11]));
        assert!(c.get(S, &[4; 32]).is_none(), "larger than the cache");
    }

    fn image(fill: u8, len: usize) -> (Bytes, [u8; 32]) {
        let data = vec![fill; len];
        let hash: [u8; 32] = Sha256::digest(&data).into();
        (Bytes::from(data), hash)
    }

    #[test]
    fn a_directory_shares_images_between_caches_and_checks_their_hash() {
        let dir = tempfile::tempdir().unwrap();
        let a = ModuleCache::with_dir(100, Some(dir.path().to_owned()));
        let b = ModuleCache::with_dir(100, Some(dir.path().to_owned()));
        let (img, hash) = image(7, 30);
        a.insert(S, hash, img.clone());
        a.flush();
        assert_eq!(
            b.get(S, &hash).as_deref(),
            Some(&img[..]),
            "b reads what a wrote"
        );
        assert_eq!(b.len(), 1, "and keeps it in memory");
        // Nothing but the entry: the temporary file was renamed.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![hex(&scoped(S, &hash))]);
        // A corrupted file is refused and removed.
        let (img2, hash2) = image(8, 30);
        std::fs::write(dir.path().join(hex(&scoped(S, &hash2))), b"not the image").unwrap();
        let c = ModuleCache::with_dir(100, Some(dir.path().to_owned()));
        assert!(c.get(S, &hash2).is_none());
        assert!(!dir.path().join(hex(&scoped(S, &hash2))).exists());
        c.insert(S, hash2, img2);
        c.flush();
        assert!(dir.path().join(hex(&scoped(S, &hash2))).exists());
    }

    #[test]
    fn the_directory_evicts_least_recently_used_files_within_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let c = ModuleCache::with_dir(100, Some(dir.path().to_owned()));
        let old = SystemTime::now() - std::time::Duration::from_secs(100);
        let (i1, h1) = image(1, 40);
        let (i2, h2) = image(2, 40);
        let (i3, h3) = image(3, 40);
        c.insert(S, h1, i1);
        c.insert(S, h2, i2);
        c.flush();
        // h1 oldest on disk, but h2 older still once h1 is used again.
        for (h, age) in [(h1, 50), (h2, 60)] {
            let f = std::fs::File::options()
                .write(true)
                .open(dir.path().join(hex(&scoped(S, &h))))
                .unwrap();
            f.set_modified(old + std::time::Duration::from_secs(age))
                .unwrap();
        }
        let fresh = ModuleCache::with_dir(100, Some(dir.path().to_owned()));
        assert!(fresh.get(S, &h1).is_some(), "refreshes h1");
        fresh.insert(S, h3, i3);
        fresh.flush();
        assert!(dir.path().join(hex(&scoped(S, &h1))).exists());
        assert!(
            !dir.path().join(hex(&scoped(S, &h2))).exists(),
            "h2 was least recently used"
        );
        assert!(dir.path().join(hex(&scoped(S, &h3))).exists());
    }

    /// Links, FIFOs and oversized files under an entry's name are not read (and a FIFO does
    /// not block); writing the entry replaces them.
    #[test]
    fn only_regular_files_of_bounded_size_are_entries() {
        let dir = tempfile::tempdir().unwrap();
        let (img, hash) = image(5, 30);
        let entry = dir.path().join(hex(&scoped(S, &hash)));
        // A link to a file holding the right image.
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, &img).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &entry).unwrap();
        let c = ModuleCache::with_dir(100, Some(dir.path().to_owned()));
        assert!(c.get(S, &hash).is_none(), "a link is not followed");
        c.insert(S, hash, img.clone());
        c.flush();
        let meta = std::fs::symlink_metadata(&entry).unwrap();
        assert!(meta.is_file(), "the link was replaced by the entry");
        // A FIFO: neither reading nor touching it blocks.
        let (img2, hash2) = image(6, 30);
        let fifo = dir.path().join(hex(&scoped(S, &hash2)));
        let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.path().to_owned();
        std::thread::spawn(move || {
            let c = ModuleCache::with_dir(100, Some(d));
            let got = c.get(S, &hash2);
            c.insert(S, hash2, img2);
            c.flush();
            tx.send(got.is_none()).unwrap();
        });
        let not_read = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("a FIFO in the cache directory blocked the cache");
        assert!(not_read);
        assert!(std::fs::symlink_metadata(&fifo).unwrap().is_file());
        // A file larger than the cache bound is not read.
        let (big, hash3) = image(7, 200);
        std::fs::write(dir.path().join(hex(&scoped(S, &hash3))), &big).unwrap();
        assert!(
            ModuleCache::with_dir(100, Some(dir.path().to_owned()))
                .get(S, &hash3)
                .is_none()
        );
    }

    /// Scopes never see each other's images, in memory or through the directory.
    #[test]
    fn a_scope_finds_only_its_own_uploads() {
        let dir = tempfile::tempdir().unwrap();
        let a = ModuleCache::with_dir(100, Some(dir.path().to_owned()));
        let (img, hash) = image(9, 20);
        a.insert("tenant:a", hash, img.clone());
        a.flush();
        assert_eq!(a.get("tenant:a", &hash).as_deref(), Some(&img[..]));
        assert!(a.get("tenant:b", &hash).is_none(), "another tenant");
        assert!(
            a.get("uid:1000", &hash).is_none(),
            "an unauthenticated user"
        );
        let other_process = ModuleCache::with_dir(100, Some(dir.path().to_owned()));
        assert!(other_process.get("tenant:b", &hash).is_none());
        assert!(other_process.get("tenant:a", &hash).is_some());
        // Scope names cannot be spliced into each other.
        assert_ne!(scoped("ab", &hash), scoped("a", &hash));
        assert!(
            !dir.path().join(hex(&hash)).exists(),
            "no entry named by the bare hash"
        );
    }
}
