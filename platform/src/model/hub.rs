//! Models and adapters from a HuggingFace hub (or a mirror of one), through the `hf-hub` crate.
//!
//! Files land in the hub's standard cache layout (`blobs/`, `snapshots/<commit>/`, `refs/`
//! under `models--org--name`), the one Python's `huggingface_hub` uses, so a file either side
//! downloaded is reused by the other. Only the files a model needs are fetched: its config and
//! tokenizer files and the safetensors shards its index names, or the one GGUF file chosen.
//! Every downloaded file is checked against the size and hash the hub lists for it (SHA-256
//! for LFS files, the git blob id for the others); a cut download resumes from its `.part`
//! file on the next try. Offline, files come from the cache only.
//!
//! The listing comes first (`/api/models/<repo>/revision/<rev>?blobs=true`), so callers can
//! check sizes against their limits before a byte of weights is fetched.

use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

use hf_hub::api::Progress;
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use serde::Deserialize;
use sha2::Digest;

/// How to reach the hub, from the command line (and the `HF_*` variables clap reads).
#[derive(Debug, Clone)]
pub struct HubOptions {
    /// The hub's address, e.g. `https://huggingface.co` or a mirror.
    pub endpoint: String,
    /// Bearer token for gated and private repositories.
    pub token: Option<String>,
    /// Never reach the hub: serve from the cache only.
    pub offline: bool,
    /// The cache directory (`.../huggingface/hub`).
    pub cache_dir: PathBuf,
    /// Show a progress bar (a terminal); otherwise one log line per file.
    pub progress: bool,
}

impl HubOptions {
    /// The cache directory the way `huggingface_hub` finds it: `HF_HUB_CACHE`, else
    /// `HF_HOME/hub`, else `~/.cache/huggingface/hub` (values passed in, not read here).
    pub fn cache_dir(hub_cache: Option<&Path>, hf_home: Option<&Path>, home: Option<&Path>) -> PathBuf {
        match (hub_cache, hf_home, home) {
            (Some(c), _, _) => c.to_path_buf(),
            (None, Some(h), _) => h.join("hub"),
            (None, None, Some(home)) => home.join(".cache").join("huggingface").join("hub"),
            (None, None, None) => PathBuf::from(".cache/huggingface/hub"),
        }
    }

    /// The token to send: the one given, else the one `hf auth login` saved in the cache's
    /// parent directory.
    fn token(&self) -> Option<String> {
        self.token.clone().filter(|t| !t.trim().is_empty()).or_else(|| {
            let saved = self.cache_dir.parent()?.join("token");
            std::fs::read_to_string(saved).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
        })
    }
}

/// What can go wrong reaching the hub; each message says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("`{0}` is not a hub repository id (expected `org/name`, optionally `@revision`)")]
    BadId(String),
    #[error("hub repository `{repo}` (revision `{revision}`) was not found at {endpoint}: check the id and the revision")]
    NotFound { repo: String, revision: String, endpoint: String },
    #[error("hub repository `{repo}` is gated or private and no token was given: accept its terms on the hub and set HF_TOKEN (or --hf-token)")]
    NeedsToken { repo: String },
    #[error("hub repository `{repo}` refused the token given (HTTP {status}): check that HF_TOKEN has access to it")]
    Refused { repo: String, status: u16 },
    #[error("cannot reach the hub at {endpoint}: {detail} (files already in the cache can be served with HF_HUB_OFFLINE=1)")]
    Network { endpoint: String, detail: String },
    #[error("hub at {endpoint} answered HTTP {status} for {what}")]
    Http { endpoint: String, status: u16, what: String },
    #[error("offline (HF_HUB_OFFLINE): `{repo}` revision `{revision}` is not in the cache {}", cache.display())]
    NotCached { repo: String, revision: String, cache: PathBuf },
    #[error("no space left on the device writing {}: free space or point HF_HUB_CACHE elsewhere", path.display())]
    DiskFull { path: PathBuf },
    #[error("{file} from `{repo}`: {detail}; the damaged copy was removed, run again to fetch it anew")]
    Integrity { repo: String, file: String, detail: String },
    #[error("{file} from `{repo}` was cut at {got} of {expected} bytes; run again to resume")]
    Cut { repo: String, file: String, got: u64, expected: u64 },
    #[error("`{repo}` holds no model this server reads: {detail}")]
    NoModel { repo: String, detail: String },
    #[error("hub listing of `{repo}` is not understood: {detail}")]
    Listing { repo: String, detail: String },
    #[error("another process is downloading {} (its lock is held); try again when it is done", path.display())]
    Locked { path: PathBuf },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// A repository id and revision, as `org/name@revision` is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub revision: String,
}

impl HubId {
    /// Parses `org/name` or `org/name@revision` (the hub's rules for names: letters, digits,
    /// `-`, `_`, `.`, at most 96 characters each part, no `--` or `..`).
    pub fn parse(text: &str) -> Result<Self, HubError> {
        let bad = || HubError::BadId(text.chars().take(200).collect());
        let (repo, revision) = match text.split_once('@') {
            Some((r, rev)) => (r, rev),
            None => (text, "main"),
        };
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 96
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && !p.starts_with(['-', '.'])
                && !p.ends_with('.')
                && !p.contains("--")
                && !p.contains("..")
        };
        let (org, name) = repo.split_once('/').ok_or_else(bad)?;
        let rev_ok = !revision.is_empty()
            && revision.len() <= 255
            && revision.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
            && !revision.contains("..")
            && !revision.starts_with('/');
        if !part_ok(org) || !part_ok(name) || !rev_ok {
            return Err(bad());
        }
        Ok(Self { repo: repo.to_string(), revision: revision.to_string() })
    }

    fn is_commit(&self) -> bool {
        self.revision.len() == 40 && self.revision.bytes().all(|b| b.is_ascii_hexdigit())
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.revision == "main" { write!(f, "{}", self.repo) } else { write!(f, "{}@{}", self.repo, self.revision) }
    }
}

/// One file of a repository as the hub lists it.
#[derive(Debug, Clone, Deserialize)]
pub struct Sibling {
    pub rfilename: String,
    /// Bytes (the LFS object's size for LFS files).
    #[serde(default)]
    pub size: Option<u64>,
    /// The git blob id (SHA-1 of `blob <len>\0<bytes>`).
    #[serde(default, rename = "blobId")]
    pub blob_id: Option<String>,
    #[serde(default)]
    pub lfs: Option<Lfs>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Lfs {
    pub sha256: String,
    pub size: u64,
}

impl Sibling {
    /// The file's size in bytes, as listed.
    pub fn bytes(&self) -> Option<u64> {
        self.lfs.as_ref().map(|l| l.size).or(self.size)
    }
}

/// A repository at one commit.
#[derive(Debug, Clone)]
pub struct Listing {
    pub id: HubId,
    /// The commit the revision points at.
    pub commit: String,
    pub files: Vec<Sibling>,
    /// From the cache (offline): sizes and hashes are unknown.
    pub cached: bool,
}

impl Listing {
    pub fn get(&self, name: &str) -> Option<&Sibling> {
        self.files.iter().find(|f| f.rfilename == name)
    }

    pub fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
}

#[derive(Deserialize)]
struct RawListing {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

/// Reaches one hub (or its cache, offline).
pub struct Hub {
    options: HubOptions,
    cache: Cache,
}

impl Hub {
    pub fn new(options: HubOptions) -> Self {
        let cache = Cache::new(options.cache_dir.clone());
        Self { options, cache }
    }

    pub fn options(&self) -> &HubOptions {
        &self.options
    }

    fn api(&self, revision: &str, id: &HubId) -> Result<hf_hub::api::sync::ApiRepo, HubError> {
        let api = ApiBuilder::from_cache(self.cache.clone())
            .with_endpoint(self.options.endpoint.trim_end_matches('/').to_string())
            .with_token(self.options.token())
            .with_progress(false)
            .with_retries(2)
            .with_user_agent("loraplex", env!("CARGO_PKG_VERSION"))
            .build()
            .map_err(|e| self.classify(e, id, "the client"))?;
        Ok(api.repo(Repo::with_revision(id.repo.clone(), RepoType::Model, revision.to_string())))
    }

    /// The repository's files at `id`'s revision: from the hub, or offline from the cache.
    pub fn list(&self, id: &HubId) -> Result<Listing, HubError> {
        if self.options.offline {
            return self.list_cached(id);
        }
        let repo = self.api(&id.revision, id)?;
        let response = repo.info_request().query("blobs", "true").call().map_err(|e| self.classify(ApiError::RequestError(Box::new(e)), id, "the listing"))?;
        let mut body = String::new();
        response
            .into_reader()
            .take(64 << 20)
            .read_to_string(&mut body)
            .map_err(|e| HubError::Network { endpoint: self.options.endpoint.clone(), detail: e.to_string() })?;
        let raw: RawListing = serde_json::from_str(&body).map_err(|e| HubError::Listing { repo: id.repo.clone(), detail: e.to_string() })?;
        let commit = raw
            .sha
            .filter(|s| s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| HubError::Listing { repo: id.repo.clone(), detail: "no commit id (`sha`) in the answer".into() })?;
        for f in &raw.siblings {
            if !safe_name(&f.rfilename) {
                return Err(HubError::Listing { repo: id.repo.clone(), detail: format!("file name {:?} is not a plain relative path", f.rfilename) });
            }
        }
        Ok(Listing { id: id.clone(), commit, files: raw.siblings, cached: false })
    }

    /// The cached snapshot of `id`, offline.
    fn list_cached(&self, id: &HubId) -> Result<Listing, HubError> {
        let not_cached = || HubError::NotCached { repo: id.repo.clone(), revision: id.revision.clone(), cache: self.options.cache_dir.clone() };
        let dir = self.repo_dir(id);
        let commit = if id.is_commit() {
            id.revision.clone()
        } else {
            std::fs::read_to_string(dir.join("refs").join(&id.revision)).map_err(|_| not_cached())?.trim().to_string()
        };
        if !(commit.len() == 40 && commit.bytes().all(|b| b.is_ascii_hexdigit())) {
            return Err(not_cached());
        }
        let snapshot = dir.join("snapshots").join(&commit);
        if !snapshot.is_dir() {
            return Err(not_cached());
        }
        let mut files = Vec::new();
        let mut stack = vec![PathBuf::new()];
        while let Some(rel) = stack.pop() {
            let entries = std::fs::read_dir(snapshot.join(&rel)).map_err(|source| HubError::Io { path: snapshot.join(&rel), source })?;
            for entry in entries.flatten() {
                let name = rel.join(entry.file_name());
                let path = snapshot.join(&name);
                if path.is_dir() {
                    if stack.len() < 1024 {
                        stack.push(name);
                    }
                } else if let Some(n) = name.to_str() {
                    files.push(Sibling { rfilename: n.replace('\\', "/"), size: path.metadata().ok().map(|m| m.len()), blob_id: None, lfs: None });
                }
            }
        }
        files.sort_by(|a, b| a.rfilename.cmp(&b.rfilename));
        Ok(Listing { id: id.clone(), commit, files, cached: true })
    }

    fn repo_dir(&self, id: &HubId) -> PathBuf {
        self.options.cache_dir.join(Repo::new(id.repo.clone(), RepoType::Model).folder_name())
    }

    /// The snapshot directory of `listing`'s commit, where its files appear by name.
    pub fn snapshot_dir(&self, listing: &Listing) -> PathBuf {
        self.repo_dir(&listing.id).join("snapshots").join(&listing.commit)
    }

    /// Makes `files` of `listing` present in its snapshot directory (downloading those
    /// missing, each checked), and returns that directory.
    pub fn fetch(&self, listing: &Listing, files: &[String]) -> Result<PathBuf, HubError> {
        let snapshot = self.snapshot_dir(listing);
        for name in files {
            let target = snapshot.join(name);
            let Some(entry) = listing.get(name) else {
                return Err(HubError::NoModel { repo: listing.id.repo.clone(), detail: format!("it has no file {name}") });
            };
            if listing.cached {
                continue;
            }
            if let (Ok(meta), Some(size)) = (target.metadata(), entry.bytes())
                && meta.len() == size
            {
                continue;
            }
            self.download(listing, entry)?;
        }
        if !listing.cached && !listing.id.is_commit() {
            // Point the revision at this commit, as huggingface_hub does, so that offline runs
            // find it by its branch or tag name.
            let refs = self.repo_dir(&listing.id).join("refs").join(&listing.id.revision);
            if let Some(parent) = refs.parent() {
                std::fs::create_dir_all(parent).map_err(|source| io_error(parent, source))?;
            }
            std::fs::write(&refs, &listing.commit).map_err(|source| io_error(&refs, source))?;
        }
        Ok(snapshot)
    }

    /// Downloads one file at the listing's commit, then checks its size and hash.
    fn download(&self, listing: &Listing, entry: &Sibling) -> Result<(), HubError> {
        let id = &listing.id;
        let name = &entry.rfilename;
        let repo = self.api(&listing.commit, id)?;
        let started = Instant::now();
        let progress = FileProgress::new(name, self.options.progress);
        let path = repo.download_with_progress(name, progress).map_err(|e| self.classify(e, id, name))?;
        // The snapshot entry links to the blob; check what is really there.
        let blob = std::fs::canonicalize(&path).map_err(|source| io_error(&path, source))?;
        let got = blob.metadata().map_err(|source| io_error(&blob, source))?.len();
        if let Some(expected) = entry.bytes()
            && got != expected
        {
            if got < expected {
                // Keep what came as the resumable part, drop the link to it.
                let mut part = blob.clone();
                part.set_extension("part");
                let _ = std::fs::rename(&blob, &part);
                let _ = std::fs::remove_file(&path);
                return Err(HubError::Cut { repo: id.repo.clone(), file: name.clone(), got, expected });
            }
            self.discard(&path, &blob);
            return Err(HubError::Integrity { repo: id.repo.clone(), file: name.clone(), detail: format!("{got} bytes, the hub lists {expected}") });
        }
        let check = match (&entry.lfs, &entry.blob_id) {
            (Some(lfs), _) => Some(("SHA-256", lfs.sha256.to_ascii_lowercase(), sha256_file(&blob)?)),
            (None, Some(blob_id)) => Some(("git blob id", blob_id.to_ascii_lowercase(), git_blob_id(&blob)?)),
            (None, None) => None,
        };
        if let Some((kind, expected, actual)) = check
            && expected != actual
        {
            self.discard(&path, &blob);
            return Err(HubError::Integrity { repo: id.repo.clone(), file: name.clone(), detail: format!("{kind} {actual}, the hub lists {expected}") });
        }
        eprintln!("fetched {} from {} ({:.1} MB in {:.1} s)", name, id, got as f64 / 1e6, started.elapsed().as_secs_f64());
        Ok(())
    }

    fn discard(&self, link: &Path, blob: &Path) {
        let _ = std::fs::remove_file(link);
        let _ = std::fs::remove_file(blob);
    }

    fn classify(&self, e: ApiError, id: &HubId, what: &str) -> HubError {
        let endpoint = self.options.endpoint.clone();
        match e {
            ApiError::RequestError(e) => match *e {
                ureq::Error::Status(404, _) => HubError::NotFound { repo: id.repo.clone(), revision: id.revision.clone(), endpoint },
                ureq::Error::Status(s @ (401 | 403), _) if self.options.token().is_some() => HubError::Refused { repo: id.repo.clone(), status: s },
                ureq::Error::Status(401 | 403, _) => HubError::NeedsToken { repo: id.repo.clone() },
                ureq::Error::Status(status, _) => HubError::Http { endpoint, status, what: what.to_string() },
                ureq::Error::Transport(t) => HubError::Network { endpoint, detail: t.to_string() },
            },
            ApiError::TooManyRetries(inner) => self.classify(*inner, id, what),
            ApiError::IoError(io) => {
                let path = self.repo_dir(id);
                if io.kind() == std::io::ErrorKind::StorageFull { HubError::DiskFull { path } } else { HubError::Io { path, source: io } }
            }
            ApiError::LockAcquisition(path) => HubError::Locked { path },
            other => HubError::Network { endpoint, detail: other.to_string() },
        }
    }
}

fn io_error(path: &Path, source: std::io::Error) -> HubError {
    if source.kind() == std::io::ErrorKind::StorageFull {
        HubError::DiskFull { path: path.to_path_buf() }
    } else {
        HubError::Io { path: path.to_path_buf(), source }
    }
}

/// A listed file name that stays inside its snapshot directory.
fn safe_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 1024
        && !name.starts_with('/')
        && !name.contains('\\')
        && !name.contains('\0')
        && name.split('/').all(|part| !part.is_empty() && part != "." && part != "..")
}

fn sha256_file(path: &Path) -> Result<String, HubError> {
    let mut hasher = sha2::Sha256::new();
    hash_file(path, |chunk| hasher.update(chunk))?;
    Ok(hex::encode(hasher.finalize()))
}

/// Git's id of a file: SHA-1 of `blob <len>\0` and the bytes.
fn git_blob_id(path: &Path) -> Result<String, HubError> {
    use sha1::Digest as _;
    let len = path.metadata().map_err(|source| io_error(path, source))?.len();
    let mut hasher = sha1::Sha1::new();
    hasher.update(format!("blob {len}\0").as_bytes());
    hash_file(path, |chunk| hasher.update(chunk))?;
    Ok(hex::encode(hasher.finalize()))
}

fn hash_file(path: &Path, mut f: impl FnMut(&[u8])) -> Result<(), HubError> {
    let mut file = std::fs::File::open(path).map_err(|source| io_error(path, source))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|source| io_error(path, source))?;
        if n == 0 {
            return Ok(());
        }
        f(&buf[..n]);
    }
}

/// A download's progress: a bar on a terminal, one line per file otherwise.
struct FileProgress {
    name: String,
    bar: Option<indicatif::ProgressBar>,
    announced: bool,
}

impl FileProgress {
    fn new(name: &str, terminal: bool) -> Self {
        let bar = (terminal && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::new(0);
            if let Ok(style) = indicatif::ProgressStyle::with_template("{msg} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} ({eta})") {
                bar.set_style(style);
            }
            bar.set_message(name.to_string());
            bar
        });
        Self { name: name.to_string(), bar, announced: false }
    }
}

impl Progress for FileProgress {
    fn init(&mut self, size: usize, _filename: &str) {
        match &self.bar {
            Some(bar) => bar.set_length(size as u64),
            None if !self.announced => eprintln!("fetching {} ({:.1} MB) ...", self.name, size as f64 / 1e6),
            None => {}
        }
        self.announced = true;
    }

    fn update(&mut self, size: usize) {
        if let Some(bar) = &self.bar {
            bar.inc(size as u64);
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests;
