//! Where adapter files live: behind an object store (the `object_store` crate), so that every
//! replica of a cluster serves every adapter.
//!
//! - **Local** (the embedded default): the objects are the files under `DATA_DIR/adapters/<blob>/`,
//!   the store's root being the data directory. An upload moves its validated files there with
//!   one rename; nothing is copied or fetched.
//! - **Remote** (`--adapter-store s3://bucket/prefix`, or `file:///path` for a filesystem every
//!   replica mounts): the objects are `<prefix>/adapters/<blob>/<file>`, and
//!   `DATA_DIR/adapters/<blob>/` is this replica's cache of them. An upload puts its files into the
//!   store before its row is recorded; a replica that meets a version it has no copy of fetches it
//!   once (concurrent requests wait for the one fetch), verifies it against the content hash the
//!   database recorded at upload (the whole adapter is loaded and hashed), and only then moves it
//!   into place. Deleting a version deletes its objects; each replica drops its copy when it sees
//!   the deletion (see [`super::cluster`]), once the requests running on it have finished.
//!
//! Transfers run on a small runtime of their own (two threads), so that neither the HTTP
//! workers nor the main thread carry object-store connections or their TLS work.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use tokio::io::AsyncWriteExt;

use super::ApiError;
use super::blocking::BlockingPool;

/// Files an adapter version consists of, in the order they are stored: the manifest last, so a
/// version whose manifest is present was stored whole.
const FILES: [&str; 3] = ["adapter_model.safetensors", "adapter_config.json", loraplex_adapters::MANIFEST_FILE];

/// Objects of versions no live row names are removed at start only when this old: a younger one
/// may belong to an upload another replica is recording right now.
const ORPHAN_AGE: Duration = Duration::from_secs(3600);

/// Why the adapter store failed.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("adapter store {0}: the object is gone (deleted meanwhile)")]
    Missing(String),
    #[error("adapter store {store}: {message}")]
    Store { store: String, message: String },
    #[error("the adapter files fetched from {store} do not verify: {message}")]
    Corrupt { store: String, message: String },
    #[error("adapter store: {0}")]
    Config(String),
}

impl From<ObjectError> for ApiError {
    fn from(e: ObjectError) -> Self {
        match e {
            ObjectError::Missing(_) => ApiError::NotFound("the adapter (deleted while this request started)".into()),
            // The store is unreachable or refused: the request may succeed later.
            ObjectError::Store { .. } => ApiError::Unavailable(e.to_string()),
            ObjectError::Corrupt { .. } | ObjectError::Config(_) => ApiError::Internal(e.to_string()),
        }
    }
}

/// The runtime object-store transfers run on.
fn io_runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("adapter-store")
            .enable_all()
            .build()
            .expect("starting the adapter store's threads")
    })
}

/// Runs `fut` on [`io_runtime`] and waits for it from any executor.
async fn on_io<T: Send + 'static>(fut: impl std::future::Future<Output = T> + Send + 'static) -> Result<T, ObjectError> {
    io_runtime().spawn(fut).await.map_err(|e| ObjectError::Config(format!("a transfer task failed: {e}")))
}

struct Remote {
    store: Arc<dyn ObjectStore>,
    /// Where the objects go, under the store's root.
    prefix: ObjectPath,
    /// The URL, for messages.
    url: String,
    /// Versions whose files this replica has in its cache.
    present: Mutex<HashSet<String>>,
    /// One lock per version being fetched, so one fetch serves every request waiting for it.
    fetching: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Checks fetched files before they are used: returns the content hash of the adapter in the
/// directory (its full validation), run on the background pool.
pub type Verify = Arc<dyn Fn(&Path) -> Result<String, String> + Send + Sync>;

/// The adapter files of this server. Cheap to share.
pub struct AdapterFiles {
    data_dir: PathBuf,
    remote: Option<Remote>,
}

impl std::fmt::Debug for AdapterFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

fn store_error(url: &str, e: object_store::Error) -> ObjectError {
    match e {
        object_store::Error::NotFound { path, .. } => ObjectError::Missing(path),
        e => ObjectError::Store { store: url.to_string(), message: e.to_string() },
    }
}

/// `files/<id>.jsonl` with an id of letters, digits, `_` and `-` only: a Batch API file.
fn checked_file(relative: &str) -> Result<&str, ObjectError> {
    match relative.strip_prefix("files/").and_then(|r| r.strip_suffix(".jsonl")) {
        Some(id) if !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') => Ok(relative),
        _ => Err(ObjectError::Config(format!("not a batch file name: {relative:?}"))),
    }
}

/// `adapters/<id>` with an id of letters, digits, `_` and `-` only: what uploads name blobs.
fn checked_blob(blob: &str) -> Result<&str, ObjectError> {
    match blob.strip_prefix("adapters/") {
        Some(id) if !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') => Ok(id),
        _ => Err(ObjectError::Config(format!("not an adapter blob name: {blob:?}"))),
    }
}

impl AdapterFiles {
    /// The embedded default: the data directory is the store.
    pub fn local(data_dir: &Path) -> Self {
        Self { data_dir: data_dir.to_path_buf(), remote: None }
    }

    /// `s3://bucket/prefix` (endpoint, region and credentials from the usual `AWS_*`
    /// variables; `AWS_ALLOW_HTTP=true` for a plain-HTTP endpoint), `file:///path`, or `None`
    /// for [`AdapterFiles::local`].
    pub fn open(url: Option<&str>, data_dir: &Path) -> Result<Self, ObjectError> {
        let Some(url) = url.filter(|u| !u.is_empty()) else { return Ok(Self::local(data_dir)) };
        let (store, prefix): (Arc<dyn ObjectStore>, ObjectPath) = if let Some(path) = url.strip_prefix("file://") {
            let root = Path::new(path);
            std::fs::create_dir_all(root).map_err(|e| ObjectError::Config(format!("creating {}: {e}", root.display())))?;
            let fs = object_store::local::LocalFileSystem::new_with_prefix(root).map_err(|e| ObjectError::Config(format!("{url}: {e}")))?;
            (Arc::new(fs), ObjectPath::default())
        } else if url.starts_with("s3://") || url.starts_with("s3a://") {
            // s3://bucket/prefix: the prefix is what follows the bucket.
            let path = url.split_once("://").and_then(|(_, rest)| rest.split_once('/')).map_or("", |(_, p)| p);
            let prefix = ObjectPath::parse(path).map_err(|e| ObjectError::Config(format!("{url}: {e}")))?;
            let s3 = object_store::aws::AmazonS3Builder::from_env().with_url(url).build().map_err(|e| ObjectError::Config(format!("{url}: {e}")))?;
            (Arc::new(s3), prefix)
        } else {
            return Err(ObjectError::Config(format!("unsupported adapter store {url:?}: use s3://bucket/prefix or file:///path")));
        };
        let remote = Remote { store, prefix, url: url.to_string(), present: Mutex::default(), fetching: Mutex::default() };
        Ok(Self { data_dir: data_dir.to_path_buf(), remote: Some(remote) })
    }

    /// What the store is, for the start-up line.
    pub fn describe(&self) -> String {
        match &self.remote {
            None => format!("the data directory {}", self.data_dir.join("adapters").display()),
            Some(r) => format!("{} (this replica's copies in {})", r.url, self.data_dir.join("adapters").display()),
        }
    }

    pub fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// The local directory of `blob` (present or not).
    pub fn dir(&self, blob: &str) -> PathBuf {
        self.data_dir.join(blob)
    }

    fn object(remote: &Remote, id: &str, file: &str) -> ObjectPath {
        remote.prefix.clone().join("adapters").join(id).join(file)
    }

    /// Stores the validated files in `scratch` as `blob`, and moves `scratch` to the blob's
    /// local directory. On an error nothing is left in the store, and `scratch` is the caller's
    /// to remove.
    pub async fn publish(&self, background: &BlockingPool, scratch: &Path, blob: &str) -> Result<(), ApiError> {
        let id = checked_blob(blob)?.to_string();
        if let Some(r) = &self.remote {
            let (store, url) = (r.store.clone(), r.url.clone());
            let objects: Vec<(PathBuf, ObjectPath)> = FILES.iter().map(|f| (scratch.join(f), Self::object(r, &id, f))).collect();
            let put = objects.clone();
            let stored = on_io(async move {
                for (file, object) in &put {
                    put_file(&store, file, object).await.map_err(|e| store_error(&url, e))?;
                }
                Ok::<(), ObjectError>(())
            })
            .await?;
            if let Err(e) = stored {
                self.delete_objects(objects.into_iter().map(|(_, o)| o).collect()).await;
                return Err(e.into());
            }
        }
        let (from, to, root) = (scratch.to_path_buf(), self.dir(blob), self.data_dir.join("adapters"));
        background
            .run(move || std::fs::create_dir_all(&root).and_then(|()| std::fs::rename(&from, &to)))
            .await?
            .map_err(|e| ApiError::Internal(format!("moving the upload into place: {e}")))?;
        if let Some(r) = &self.remote {
            lock(&r.present).insert(id);
        }
        Ok(())
    }

    /// The local directory of `blob`, whose content hash is `hash`: at once when this replica
    /// has it, else fetched from the store and verified first.
    /// `verify` is called only when the files are fetched (or a leftover copy is checked).
    pub async fn local_dir(
        &self,
        background: &BlockingPool,
        blob: &str,
        hash: &str,
        max_bytes: u64,
        verify: impl FnOnce() -> Verify,
    ) -> Result<PathBuf, ApiError> {
        let Some(r) = &self.remote else { return Ok(self.dir(blob)) };
        let id = checked_blob(blob)?.to_string();
        if lock(&r.present).contains(&id) {
            return Ok(self.dir(blob));
        }
        let gate = lock(&r.fetching).entry(id.clone()).or_default().clone();
        let _fetching = gate.lock().await;
        let fetched = if lock(&r.present).contains(&id) { Ok(()) } else { self.fetch(r, background, &id, hash, max_bytes, verify()).await };
        lock(&r.fetching).remove(&id);
        fetched?;
        Ok(self.dir(blob))
    }

    async fn fetch(&self, r: &Remote, background: &BlockingPool, id: &str, hash: &str, max_bytes: u64, verify: Verify) -> Result<(), ApiError> {
        let target = self.dir(&format!("adapters/{id}"));
        // A copy left by an earlier run (the start-up sweep kept it: its version is live) is
        // verified like a fetched one.
        let scratch_root = self.data_dir.join("uploads");
        let scratch = scratch_root.join(crate::store::random_id("fetch"));
        let (check_target, made) = (target.clone(), scratch.clone());
        let present = background
            .run(move || std::fs::create_dir_all(&made).map(|()| check_target.join(loraplex_adapters::MANIFEST_FILE).is_file()))
            .await?
            .map_err(|e| ApiError::Internal(format!("creating {}: {e}", scratch.display())))?;
        let guard = super::adapters::Scratch(Some(scratch.clone()));
        let source = if present {
            // A copy an earlier run left (the start-up sweep keeps those of live versions): it is
            // verified like a fetched one, and removed if it does not verify.
            target.clone()
        } else {
            let (store, url) = (r.store.clone(), r.url.clone());
            let files: Vec<(ObjectPath, PathBuf)> = FILES.iter().map(|f| (Self::object(r, id, f), scratch.join(f))).collect();
            // The weights and config are the bytes the row counts; the manifest is bounded by
            // its reader.
            on_io(async move {
                let mut left = max_bytes;
                for (object, file) in &files {
                    let manifest = object.filename() == Some(loraplex_adapters::MANIFEST_FILE);
                    let limit = if manifest { loraplex_adapters::validated::MAX_MANIFEST_BYTES } else { left };
                    let got = get_file(&store, object, file, limit).await.map_err(|e| match e {
                        Fetch::Store(e) => store_error(&url, e),
                        Fetch::Io(e) => ObjectError::Config(format!("writing {}: {e}", file.display())),
                        Fetch::TooLarge => ObjectError::Corrupt { store: url.clone(), message: format!("{object} is larger than the version's recorded size") },
                    })?;
                    if !manifest {
                        left -= got;
                    }
                }
                Ok::<(), ObjectError>(())
            })
            .await??;
            scratch.clone()
        };
        let (expected, url) = (hash.to_string(), r.url.clone());
        let (from, to) = (source.clone(), target.clone());
        background
            .run(move || -> Result<(), ObjectError> {
                let got = verify(&from).map_err(|message| ObjectError::Corrupt { store: url.clone(), message });
                if got.as_ref().map_or(true, |h| *h != expected) && from == to {
                    super::adapters::remove_dir(&to);
                }
                let got = got?;
                if got != expected {
                    return Err(ObjectError::Corrupt { store: url, message: format!("content hash {got}, the upload recorded {expected}") });
                }
                if from != to {
                    let _ = std::fs::remove_dir_all(&to);
                    std::fs::create_dir_all(to.parent().unwrap_or(&to))
                        .and_then(|()| std::fs::rename(&from, &to))
                        .map_err(|e| ObjectError::Config(format!("moving the fetched files into place: {e}")))?;
                }
                Ok(())
            })
            .await??;
        drop(guard);
        lock(&r.present).insert(id.to_string());
        Ok(())
    }

    /// Stores the Batch API file at `relative` (a path under the data directory, where it is) so
    /// that every replica can read it; nothing to do on the local store.
    pub async fn put_file(&self, relative: &str) -> Result<(), ApiError> {
        let Some(r) = &self.remote else { return Ok(()) };
        let object = r.prefix.clone().join("files").join(checked_file(relative)?.trim_start_matches("files/"));
        let (store, url, file) = (r.store.clone(), r.url.clone(), self.data_dir.join(relative));
        on_io(async move { put_file(&store, &file, &object).await.map_err(|e| store_error(&url, e)) }).await??;
        Ok(())
    }

    /// The local path of the Batch API file `relative`, of `size` bytes: at once when this
    /// replica has it whole, else fetched from the store first.
    pub async fn local_file(&self, background: &BlockingPool, relative: &str, size: u64) -> Result<PathBuf, ApiError> {
        let path = self.data_dir.join(relative);
        let Some(r) = &self.remote else { return Ok(path) };
        let name = checked_file(relative)?.trim_start_matches("files/").to_string();
        let have = |path: PathBuf| async move { background.run(move || std::fs::metadata(&path).map(|m| m.len()).unwrap_or(u64::MAX)).await };
        if have(path.clone()).await? == size {
            return Ok(path);
        }
        let gate = lock(&r.fetching).entry(relative.to_string()).or_default().clone();
        let _fetching = gate.lock().await;
        let fetched = async {
            if have(path.clone()).await? == size {
                return Ok(());
            }
            let partial = path.with_extension(format!("fetch-{}", crate::store::random_id("p")));
            let guard = super::files::Scratch(Some(partial.clone()));
            let (store, url, object, into) = (r.store.clone(), r.url.clone(), r.prefix.clone().join("files").join(name.as_str()), partial.clone());
            let parent = path.parent().map(Path::to_path_buf);
            background
                .run(move || parent.map_or(Ok(()), std::fs::create_dir_all))
                .await?
                .map_err(|e| ApiError::Internal(format!("creating the files directory: {e}")))?;
            let got = on_io(async move {
                get_file(&store, &object, &into, size).await.map_err(|e| match e {
                    Fetch::Store(e) => store_error(&url, e),
                    Fetch::Io(e) => ObjectError::Config(format!("writing {}: {e}", into.display())),
                    Fetch::TooLarge => ObjectError::Corrupt { store: url.clone(), message: format!("{object} is larger than its record says") },
                })
            })
            .await??;
            if got != size {
                return Err(ObjectError::Corrupt { store: r.url.clone(), message: format!("{relative} has {got} bytes, its record says {size}") }.into());
            }
            let (from, to) = (partial.clone(), path.clone());
            background.run(move || std::fs::rename(from, to)).await?.map_err(|e| ApiError::Internal(format!("moving a fetched file into place: {e}")))?;
            drop(guard);
            Ok::<(), ApiError>(())
        }
        .await;
        lock(&r.fetching).remove(relative);
        fetched?;
        Ok(path)
    }

    /// Deletes the stored copy of the Batch API file `relative` (failures are logged).
    pub async fn remove_file(&self, relative: &str) {
        let (Some(r), Ok(relative)) = (&self.remote, checked_file(relative)) else { return };
        self.delete_objects(vec![r.prefix.clone().join("files").join(relative.trim_start_matches("files/"))]).await;
    }

    /// This replica no longer keeps `blob` (its version was deleted, and its directory removed).
    pub fn forget(&self, blob: &str) {
        if let (Some(r), Ok(id)) = (&self.remote, checked_blob(blob)) {
            lock(&r.present).remove(id);
        }
    }

    /// Deletes the objects of `blob` (a deleted version); failures are logged (the start-up
    /// sweep of a later run removes what is left).
    pub async fn remove(&self, blob: &str) {
        let (Some(r), Ok(id)) = (&self.remote, checked_blob(blob)) else { return };
        self.delete_objects(FILES.iter().map(|f| Self::object(r, id, f)).collect()).await;
    }

    async fn delete_objects(&self, objects: Vec<ObjectPath>) {
        let Some(r) = &self.remote else { return };
        let (store, url) = (r.store.clone(), r.url.clone());
        let _ = on_io(async move {
            for o in objects {
                match store.delete(&o).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => eprintln!("warning: adapter store {url}: could not delete {o}: {e}"),
                }
            }
        })
        .await;
    }

    /// At start: removes the objects of versions no live row names, when older than an hour
    /// (an upload elsewhere may be recording a younger one). Returns how many versions went.
    pub async fn sweep(&self, live: &HashSet<String>) -> Result<usize, ObjectError> {
        let Some(r) = &self.remote else { return Ok(0) };
        let (store, url, root) = (r.store.clone(), r.url.clone(), r.prefix.clone().join("adapters"));
        let live: HashSet<String> = live.iter().filter_map(|b| checked_blob(b).ok().map(str::to_string)).collect();
        on_io(async move {
            let cutoff = chrono_now() - ORPHAN_AGE.as_secs() as i64;
            let mut listing = store.list(Some(&root));
            let mut orphans: HashMap<String, Vec<ObjectPath>> = HashMap::new();
            let mut young: HashSet<String> = HashSet::new();
            while let Some(meta) = listing.next().await {
                let meta = meta.map_err(|e| store_error(&url, e))?;
                let Some(id) = meta.location.prefix_match(&root).and_then(|mut parts| parts.next()).map(|p| p.as_ref().to_string()) else { continue };
                if live.contains(&id) {
                    continue;
                }
                if meta.last_modified.timestamp() > cutoff {
                    young.insert(id.clone());
                }
                orphans.entry(id).or_default().push(meta.location);
            }
            let mut removed = 0;
            for (id, objects) in orphans {
                if young.contains(&id) {
                    continue;
                }
                for o in objects {
                    store.delete(&o).await.map_err(|e| store_error(&url, e))?;
                }
                removed += 1;
            }
            Ok(removed)
        })
        .await?
    }
}

/// Unix seconds now.
fn chrono_now() -> i64 {
    crate::store::now_ms() / 1000
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Puts a file as one object, in parts when large.
async fn put_file(store: &Arc<dyn ObjectStore>, file: &Path, object: &ObjectPath) -> Result<(), object_store::Error> {
    let mut input = tokio::fs::File::open(file).await.map_err(|e| object_store::Error::Generic { store: "file", source: Box::new(e) })?;
    let mut writer = object_store::buffered::BufWriter::new(store.clone(), object.clone());
    let copied = tokio::io::copy(&mut input, &mut writer).await;
    match copied {
        Ok(_) => writer.shutdown().await.map_err(|e| object_store::Error::Generic { store: "upload", source: Box::new(e) }),
        Err(e) => {
            let _ = writer.abort().await;
            Err(object_store::Error::Generic { store: "upload", source: Box::new(e) })
        }
    }
}

enum Fetch {
    Store(object_store::Error),
    Io(std::io::Error),
    TooLarge,
}

/// Streams one object into `file`, refusing more than `limit` bytes; returns its size.
async fn get_file(store: &Arc<dyn ObjectStore>, object: &ObjectPath, file: &Path, limit: u64) -> Result<u64, Fetch> {
    let got = store.get(object).await.map_err(Fetch::Store)?;
    if got.meta.size > limit {
        return Err(Fetch::TooLarge);
    }
    let mut out = tokio::fs::File::create(file).await.map_err(Fetch::Io)?;
    let mut stream = got.into_stream();
    let mut written = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(Fetch::Store)?;
        written = written.saturating_add(chunk.len() as u64);
        if written > limit {
            return Err(Fetch::TooLarge);
        }
        out.write_all(&chunk).await.map_err(Fetch::Io)?;
    }
    out.flush().await.map_err(Fetch::Io)?;
    out.sync_all().await.map_err(Fetch::Io)?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn only_upload_blob_names_are_used_as_paths() {
        assert_eq!(checked_blob("adapters/blob_abc-1").unwrap(), "blob_abc-1");
        for bad in ["adapters/", "adapters/../x", "adapters/a/b", "x/y", "adapters/a.b", ""] {
            assert!(checked_blob(bad).is_err(), "{bad}");
        }
    }

    /// A stand-in for the adapter's validation: a hash of the three files.
    fn digest(dir: &Path) -> Result<String, String> {
        let mut h = Sha256::new();
        for f in FILES {
            h.update(std::fs::read(dir.join(f)).map_err(|e| e.to_string())?);
        }
        Ok(crate::store::hex(&h.finalize()))
    }

    fn scratch(root: &Path, name: &str, weights: &[u8]) -> (PathBuf, String) {
        let dir = root.join("uploads").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, f) in FILES.iter().enumerate() {
            let body = if i == 0 { weights.to_vec() } else { format!("{f} of {name}").into_bytes() };
            std::fs::write(dir.join(f), body).unwrap();
        }
        let hash = digest(&dir).unwrap();
        (dir, hash)
    }

    #[actix_web::test]
    async fn replicas_share_adapter_files_through_the_store_and_verify_what_they_fetch() {
        let root = tempfile::tempdir().unwrap();
        let url = format!("file://{}", root.path().join("store").display());
        let (a_dir, b_dir, c_dir) = (root.path().join("a"), root.path().join("b"), root.path().join("c"));
        let a = AdapterFiles::open(Some(&url), &a_dir).unwrap();
        let b = AdapterFiles::open(Some(&url), &b_dir).unwrap();
        assert!(a.is_remote() && !AdapterFiles::open(None, &a_dir).unwrap().is_remote());
        assert!(AdapterFiles::open(Some("ftp://x"), &a_dir).is_err());
        let pool = BlockingPool::new(2, 16);
        let verify: Verify = Arc::new(|dir: &Path| digest(dir));
        let weights = vec![7u8; 300_000];

        // Stored by A: the objects are there, and A's copy is the moved scratch directory.
        let (up, hash) = scratch(&a_dir, "up1", &weights);
        a.publish(&pool, &up, "adapters/blob_1").await.unwrap();
        assert!(!up.exists());
        assert_eq!(std::fs::read(root.path().join("store/adapters/blob_1/adapter_model.safetensors")).unwrap(), weights);
        assert_eq!(a.local_dir(&pool, "adapters/blob_1", &hash, 1 << 20, || verify.clone()).await.unwrap(), a_dir.join("adapters/blob_1"));

        // B fetches it once, verified, into its own directory; concurrent requests share the fetch.
        let (one, two) = futures::future::join(
            b.local_dir(&pool, "adapters/blob_1", &hash, 1 << 20, || verify.clone()),
            b.local_dir(&pool, "adapters/blob_1", &hash, 1 << 20, || verify.clone()),
        )
        .await;
        assert_eq!(one.unwrap(), b_dir.join("adapters/blob_1"));
        assert_eq!(two.unwrap(), b_dir.join("adapters/blob_1"));
        assert_eq!(digest(&b_dir.join("adapters/blob_1")).unwrap(), hash);
        assert!(std::fs::read_dir(b_dir.join("uploads")).unwrap().next().is_none(), "no scratch left behind");

        // Larger than the recorded size, or not what was recorded: refused, nothing kept.
        let c = AdapterFiles::open(Some(&url), &c_dir).unwrap();
        match c.local_dir(&pool, "adapters/blob_1", &hash, 1000, || verify.clone()).await {
            Err(ApiError::Internal(m)) => assert!(m.contains("larger than"), "{m}"),
            other => panic!("{other:?}"),
        }
        let (up, hash2) = scratch(&a_dir, "up2", &[1, 2, 3]);
        a.publish(&pool, &up, "adapters/blob_2").await.unwrap();
        std::fs::write(root.path().join("store/adapters/blob_2/adapter_model.safetensors"), [1, 2, 4]).unwrap();
        match c.local_dir(&pool, "adapters/blob_2", &hash2, 1 << 20, || verify.clone()).await {
            Err(ApiError::Internal(m)) => assert!(m.contains("do not verify"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(!c_dir.join("adapters/blob_2").exists());

        // Deleted: its objects go, and a replica without a copy reads it as gone.
        a.remove("adapters/blob_1").await;
        assert!(!root.path().join("store/adapters/blob_1/adapter_model.safetensors").exists());
        assert!(matches!(c.local_dir(&pool, "adapters/blob_1", &hash, 1 << 20, || verify.clone()).await, Err(ApiError::NotFound(_))));

        // The sweep removes versions no row names, once old enough to be no upload in progress.
        let (up, _) = scratch(&a_dir, "up3", &[9]);
        a.publish(&pool, &up, "adapters/blob_3").await.unwrap();
        let live: HashSet<String> = ["adapters/blob_2".to_string()].into();
        assert_eq!(a.sweep(&live).await.unwrap(), 0, "young objects stay");
        let old = std::time::SystemTime::now() - Duration::from_secs(2 * 3600);
        for f in FILES {
            std::fs::File::options().write(true).open(root.path().join("store/adapters/blob_3").join(f)).unwrap().set_modified(old).unwrap();
        }
        assert_eq!(a.sweep(&live).await.unwrap(), 1);
        assert!(!root.path().join("store/adapters/blob_3").join(FILES[2]).exists());
        assert!(root.path().join("store/adapters/blob_2").join(FILES[2]).exists());
    }
}
