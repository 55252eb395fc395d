//! The hub client against a mock hub on a local port, answering as the hub does: a listing
//! with sizes and hashes, `resolve` URLs with commit and etag headers, LFS files behind an
//! absolute redirect to a CDN that honours ranges.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use sha1::Digest as _;

use super::*;
use crate::model::source::{self, ModelFiles, ModelSpec};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

#[derive(Clone)]
struct File {
    bytes: Vec<u8>,
    lfs: bool,
    /// Served instead of `bytes` (a corrupt upload).
    served: Option<Vec<u8>>,
}

#[derive(Default)]
struct State {
    repos: HashMap<String, HashMap<String, File>>,
    /// Repos that need `Authorization: Bearer good`.
    gated: Vec<String>,
    /// Files whose first full download is cut halfway.
    cut_once: Vec<String>,
    /// Every request: method, path, Range header.
    log: Vec<(String, String, Option<String>)>,
}

struct MockHub {
    url: String,
    state: Arc<Mutex<State>>,
}

impl MockHub {
    fn start(state: State) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(state));
        let shared = state.clone();
        let base = url.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (state, base) = (shared.clone(), base.clone());
                std::thread::spawn(move || serve(conn, &state, &base));
            }
        });
        Self { url, state }
    }

    fn requests(&self, path_part: &str) -> Vec<(String, String, Option<String>)> {
        self.state.lock().unwrap().log.iter().filter(|r| r.1.contains(path_part)).cloned().collect()
    }
}

fn sha256(b: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(b))
}

fn blob_id(b: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", b.len()).as_bytes());
    h.update(b);
    hex::encode(h.finalize())
}

fn respond(conn: &mut TcpStream, status: &str, headers: &[(String, String)], body: &[u8]) {
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = conn.write_all(head.as_bytes());
    let _ = conn.write_all(body);
}

fn serve(mut conn: TcpStream, state: &Mutex<State>, base: &str) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let range = headers.get("range").cloned();
    let mut st = state.lock().unwrap();
    st.log.push((method.clone(), target.clone(), range.clone()));
    let path = target.split('?').next().unwrap_or("").to_string();
    let authorized = headers.get("authorization").map(String::as_str) == Some("Bearer good");
    let not_found =
        |conn: &mut TcpStream| respond(conn, "404 Not Found", &[("X-Error-Code".into(), "RepoNotFound".into())], b"{\"error\":\"Repository not found\"}");

    if let Some(rest) = path.strip_prefix("/cdn/") {
        // /cdn/org/name/sha256
        let (repo, sha) = rest.rsplit_once('/').unwrap_or(("", rest));
        let file = st.repos.get(repo).and_then(|r| r.values().find(|f| sha256(&f.bytes) == sha)).cloned();
        let Some(file) = file else { return not_found(&mut conn) };
        let cut = st.cut_once.iter().position(|s| s == sha);
        drop(st);
        let served = file.served.unwrap_or(file.bytes);
        let (start, end) = parse_range(range.as_deref(), served.len());
        let body = &served[start..=end];
        let headers = [("Content-Range".to_string(), format!("bytes {start}-{end}/{}", served.len()))];
        if let (Some(i), true) = (cut, start == 0 && end + 1 == served.len()) {
            state.lock().unwrap().cut_once.remove(i);
            // Promise the whole body, send half of it, hang up.
            let head =
                format!("HTTP/1.1 206 Partial Content\r\nConnection: close\r\nContent-Length: {}\r\nContent-Range: {}\r\n\r\n", body.len(), headers[0].1);
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(&body[..body.len() / 2]);
            let _ = conn.flush();
            let _ = conn.shutdown(std::net::Shutdown::Both);
            return;
        }
        return respond(&mut conn, "206 Partial Content", &headers, body);
    }
    if let Some(rest) = path.strip_prefix("/api/models/") {
        // org/name/revision/rev
        let segs: Vec<&str> = rest.splitn(4, '/').collect();
        let repo = format!("{}/{}", segs.first().unwrap_or(&""), segs.get(1).unwrap_or(&""));
        if st.gated.contains(&repo) && !authorized {
            return respond(&mut conn, "401 Unauthorized", &[], b"{\"error\":\"Access to model is restricted\"}");
        }
        let Some(files) = st.repos.get(&repo) else { return not_found(&mut conn) };
        if segs.get(3).is_some_and(|rev| *rev != "main" && *rev != COMMIT) {
            return respond(&mut conn, "404 Not Found", &[("X-Error-Code".into(), "RevisionNotFound".into())], b"{}");
        }
        let mut names: Vec<&String> = files.keys().collect();
        names.sort();
        let siblings: Vec<serde_json::Value> = names
            .iter()
            .map(|n| {
                let f = &files[*n];
                let mut s = serde_json::json!({"rfilename": n, "size": f.bytes.len(), "blobId": blob_id(&f.bytes)});
                if f.lfs {
                    s["lfs"] = serde_json::json!({"sha256": sha256(&f.bytes), "size": f.bytes.len(), "pointerSize": 134});
                }
                s
            })
            .collect();
        let body = serde_json::json!({"id": repo, "sha": COMMIT, "siblings": siblings}).to_string();
        return respond(&mut conn, "200 OK", &[("Content-Type".into(), "application/json".into())], body.as_bytes());
    }
    // /org/name/resolve/rev/file
    let segs: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    if segs.len() == 5 && segs[2] == "resolve" {
        let repo = format!("{}/{}", segs[0], segs[1]);
        if st.gated.contains(&repo) && !authorized {
            return respond(&mut conn, "401 Unauthorized", &[], b"");
        }
        let Some(file) = st.repos.get(&repo).and_then(|r| r.get(segs[4])).cloned() else { return not_found(&mut conn) };
        drop(st);
        let mut headers = vec![("X-Repo-Commit".to_string(), COMMIT.to_string())];
        if file.lfs {
            let sha = sha256(&file.bytes);
            headers.push(("X-Linked-Etag".into(), format!("\"{sha}\"")));
            headers.push(("X-Linked-Size".into(), file.bytes.len().to_string()));
            headers.push(("Location".into(), format!("{base}/cdn/{repo}/{sha}")));
            return respond(&mut conn, "302 Found", &headers, b"");
        }
        let served = file.served.clone().unwrap_or(file.bytes.clone());
        let (start, end) = parse_range(range.as_deref(), served.len());
        headers.push(("ETag".into(), format!("\"{}\"", blob_id(&file.bytes))));
        headers.push(("Content-Range".into(), format!("bytes {start}-{end}/{}", served.len())));
        return respond(&mut conn, "206 Partial Content", &headers, &served[start..=end]);
    }
    drop(st);
    not_found(&mut conn)
}

fn parse_range(range: Option<&str>, len: usize) -> (usize, usize) {
    let last = len.saturating_sub(1);
    let Some(spec) = range.and_then(|r| r.strip_prefix("bytes=")) else { return (0, last) };
    let (a, b) = spec.split_once('-').unwrap_or((spec, ""));
    let start = a.parse().unwrap_or(0).min(last);
    let end = b.parse().unwrap_or(last).min(last);
    (start, end.max(start))
}

fn file(bytes: &[u8], lfs: bool) -> File {
    File { bytes: bytes.to_vec(), lfs, served: None }
}

fn weights() -> Vec<u8> {
    (0..300_000u32).flat_map(|i| (i.wrapping_mul(2_654_435_761)).to_le_bytes()).collect()
}

fn state() -> State {
    let mut st = State::default();
    let tiny: HashMap<String, File> = [
        ("config.json", file(b"{\"architectures\": [\"LlamaForCausalLM\"]}", false)),
        ("tokenizer.json", file(b"{}", false)),
        ("README.md", file(b"# tiny", false)),
        ("model.safetensors", file(&weights(), true)),
    ]
    .into_iter()
    .map(|(n, f)| (n.to_string(), f))
    .collect();
    st.repos.insert("org/tiny".into(), tiny.clone());
    st.repos.insert("org/gated".into(), tiny.clone());
    st.gated.push("org/gated".into());
    let mut bad = tiny.clone();
    bad.get_mut("model.safetensors").unwrap().served = Some(weights().iter().map(|b| b ^ 1).collect());
    st.repos.insert("org/bad".into(), bad);
    let ggufs: HashMap<String, File> =
        [("m-Q4_0.gguf", file(b"GGUF-q4", true)), ("m-Q8_0.gguf", file(b"GGUF-q8-bytes", true)), ("README.md", file(b"x", false))]
            .into_iter()
            .map(|(n, f)| (n.to_string(), f))
            .collect();
    st.repos.insert("org/ggufs".into(), ggufs);
    st
}

fn hub(url: &str, cache: &Path, token: Option<&str>, offline: bool) -> Hub {
    Hub::new(HubOptions { endpoint: url.to_string(), token: token.map(str::to_string), offline, cache_dir: cache.to_path_buf(), progress: false })
}

fn resolve(hub: &Hub, id: &str, gguf: Option<&str>) -> Result<ModelFiles, source::SourceError> {
    source::resolve(&ModelSpec::parse(id).unwrap(), gguf, hub).map(|r| r.files)
}

#[test]
fn downloads_what_a_checkpoint_needs_into_the_standard_cache_and_reuses_it() {
    let mock = MockHub::start(state());
    let cache = tempfile::tempdir().unwrap();
    let h = hub(&mock.url, cache.path(), None, false);
    let files = resolve(&h, "org/tiny", None).unwrap();
    let dir = cache.path().join("models--org--tiny").join("snapshots").join(COMMIT);
    assert_eq!(files, ModelFiles::Dir(dir.clone()));
    assert_eq!(std::fs::read(dir.join("model.safetensors")).unwrap(), weights());
    assert!(dir.join("config.json").is_file() && dir.join("tokenizer.json").is_file());
    assert!(!dir.join("README.md").exists(), "only the files a model needs are fetched");
    assert_eq!(std::fs::read_to_string(cache.path().join("models--org--tiny/refs/main")).unwrap(), COMMIT);
    let blob = cache.path().join("models--org--tiny/blobs").join(sha256(&weights()));
    assert!(blob.is_file(), "blobs are named by their etag, as huggingface_hub names them");
    let fetched = mock.requests("/cdn/").len();
    // Once cached, nothing is downloaded again (the listing is still asked for).
    resolve(&h, "org/tiny", None).unwrap();
    assert_eq!(mock.requests("/cdn/").len(), fetched);
    // Offline: no request at all, the same files.
    let before = mock.state.lock().unwrap().log.len();
    let offline = hub(&mock.url, cache.path(), None, true);
    assert_eq!(resolve(&offline, "org/tiny", None).unwrap(), ModelFiles::Dir(dir.clone()));
    assert_eq!(resolve(&offline, &format!("org/tiny@{COMMIT}"), None).unwrap(), ModelFiles::Dir(dir));
    assert_eq!(mock.state.lock().unwrap().log.len(), before);
    let e = resolve(&offline, "org/ggufs", None).unwrap_err().to_string();
    assert!(e.contains("offline") && e.contains("not in the cache"), "{e}");
}

#[test]
fn a_cut_download_resumes_where_it_stopped() {
    let mut st = state();
    st.cut_once.push(sha256(&weights()));
    let mock = MockHub::start(st);
    let cache = tempfile::tempdir().unwrap();
    let files = resolve(&hub(&mock.url, cache.path(), None, false), "org/tiny", None).unwrap();
    assert_eq!(std::fs::read(files.path().join("model.safetensors")).unwrap(), weights());
    let ranges: Vec<Option<String>> = mock.requests("/cdn/").into_iter().map(|r| r.2).collect();
    let half = weights().len() / 2;
    assert!(ranges.contains(&Some(format!("bytes={half}-"))), "resumed from the cut: {ranges:?}");
}

#[test]
fn a_file_whose_hash_differs_from_the_listing_is_refused_and_removed() {
    let mock = MockHub::start(state());
    let cache = tempfile::tempdir().unwrap();
    let e = resolve(&hub(&mock.url, cache.path(), None, false), "org/bad", None).unwrap_err().to_string();
    assert!(e.contains("model.safetensors") && e.contains("SHA-256") && e.contains(&sha256(&weights())), "{e}");
    let blob = cache.path().join("models--org--bad/blobs").join(sha256(&weights()));
    assert!(!blob.exists(), "the damaged blob is gone");
    assert!(!cache.path().join("models--org--bad/snapshots").join(COMMIT).join("model.safetensors").exists());
}

#[test]
fn gated_unknown_and_unreachable_are_explained() {
    let mock = MockHub::start(state());
    let cache = tempfile::tempdir().unwrap();
    let e = resolve(&hub(&mock.url, cache.path(), None, false), "org/gated", None).unwrap_err().to_string();
    assert!(e.contains("gated") && e.contains("HF_TOKEN"), "{e}");
    let e = resolve(&hub(&mock.url, cache.path(), Some("wrong"), false), "org/gated", None).unwrap_err().to_string();
    assert!(e.contains("refused the token") && e.contains("401"), "{e}");
    resolve(&hub(&mock.url, cache.path(), Some("good"), false), "org/gated", None).unwrap();
    let e = resolve(&hub(&mock.url, cache.path(), None, false), "org/nope", None).unwrap_err().to_string();
    assert!(e.contains("`org/nope`") && e.contains("not found"), "{e}");
    let e = resolve(&hub(&mock.url, cache.path(), None, false), "org/tiny@v9", None).unwrap_err().to_string();
    assert!(e.contains("`v9`") && e.contains("not found"), "{e}");
    // Nothing listens on a port just freed.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let e = resolve(&hub(&format!("http://{closed}"), cache.path(), None, false), "org/tiny", None).unwrap_err().to_string();
    assert!(e.contains("cannot reach the hub") && e.contains("HF_HUB_OFFLINE"), "{e}");
}

#[test]
fn one_gguf_file_is_chosen_by_name_or_quantization() {
    let mock = MockHub::start(state());
    let cache = tempfile::tempdir().unwrap();
    let h = hub(&mock.url, cache.path(), None, false);
    let e = resolve(&h, "org/ggufs", None).unwrap_err().to_string();
    assert!(e.contains("--gguf-file") && e.contains("m-Q4_0.gguf"), "{e}");
    let files = resolve(&h, "org/ggufs", Some("Q8_0")).unwrap();
    let ModelFiles::Gguf(path) = files else { panic!("{files:?}") };
    assert_eq!(std::fs::read(&path).unwrap(), b"GGUF-q8-bytes");
    assert!(!path.with_file_name("m-Q4_0.gguf").exists(), "only the chosen file is fetched");
}
