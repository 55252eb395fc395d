//! The server under test: the real binary, on SQLite or on a fresh PostgreSQL database, and
//! the calls the cases make.

use std::path::{Path, PathBuf};
use std::time::Duration;

use loraplex::bench::http::{Client, Request, Response, multipart};
use loraplex::bench::server::Server;
use serde_json::{Value, json};

pub const ADMIN: &str = "operator-key-0123456789abcdef";
pub const MODEL: &str = "loraplex-tiny";

/// A database the server can run on.
#[derive(Debug, Clone)]
pub enum Db {
    Sqlite,
    /// A PostgreSQL server's URL (a new database is made on it for each environment).
    Postgres(String),
}

/// SQLite always; PostgreSQL too when `LORAPLEX_TEST_POSTGRES` names a server (`.ci/run` starts
/// one, and requires it with `LORAPLEX_REQUIRE_POSTGRES`).
pub fn databases() -> Vec<Db> {
    let mut out = vec![Db::Sqlite];
    match std::env::var("LORAPLEX_TEST_POSTGRES") {
        Ok(url) => out.push(Db::Postgres(url)),
        Err(_) => {
            assert!(std::env::var_os("LORAPLEX_REQUIRE_POSTGRES").is_none(), "LORAPLEX_REQUIRE_POSTGRES is set but LORAPLEX_TEST_POSTGRES is not");
            eprintln!("LORAPLEX_TEST_POSTGRES is not set: the suite runs on SQLite only (.ci/run starts a PostgreSQL server)");
        }
    }
    out
}

/// Runs `f` on a current-thread tokio runtime (for sqlx).
pub fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

/// A new, empty PostgreSQL database on the server at `url`; its URL.
fn fresh_postgres(url: &str) -> String {
    sqlx::any::install_default_drivers();
    let name = format!("edge_{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    block_on(async {
        let admin = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(url).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await.unwrap();
        admin.close().await;
    });
    let base = url.rsplit_once('/').map_or(url, |(b, _)| b);
    format!("{base}/{name}")
}

/// A running server with its data directory and database.
pub struct Env {
    pub server: Server,
    pub dir: tempfile::TempDir,
    pub db_url: String,
    pub args: Vec<String>,
    pub http: Client,
}

pub fn exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_loraplex"))
}

impl Env {
    /// A fresh server on `db` with `args` added to `serve`'s.
    pub fn start(db: &Db, args: &[&str]) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let db_url = match db {
            Db::Sqlite => format!("sqlite://{}", dir.path().join("loraplex.db").display()),
            Db::Postgres(url) => fresh_postgres(url),
        };
        let mut all: Vec<String> = vec!["--admin-key".into(), ADMIN.into(), "--database-url".into(), db_url.clone()];
        all.extend(args.iter().map(|s| s.to_string()));
        let server = Self::spawn(dir.path(), &all);
        let http = server.client();
        Env { server, dir, db_url, args: all, http }
    }

    fn spawn(dir: &Path, args: &[String]) -> Server {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Server::start(exe(), &dir.join("data"), &args).unwrap()
    }

    /// Kills the server (SIGKILL, as a crash) and starts it again on the same data and database.
    pub fn crash_and_restart(&mut self) {
        self.server.kill();
        self.server = Self::spawn(self.dir.path(), &self.args);
        self.http = self.server.client();
    }

    /// Stops the server (SIGKILL) and starts it again on the same data and database, with
    /// `extra` added to its arguments from now on.
    pub fn restart_with(&mut self, extra: &[&str]) {
        self.args.extend(extra.iter().map(|s| s.to_string()));
        self.crash_and_restart();
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn kind(&self) -> &'static str {
        if self.db_url.starts_with("sqlite") { "sqlite" } else { "postgres" }
    }

    pub fn call(&self, key: Option<&str>, method: &str, path: &str, body: Option<Value>) -> Response {
        self.http.json(method, path, key, body.as_ref()).unwrap()
    }

    pub fn admin(&self, method: &str, path: &str, body: Option<Value>) -> Response {
        self.call(Some(ADMIN), method, path, body)
    }

    /// A tenant with `limits`, and a key with the inference and adapters scopes: (id, key).
    pub fn tenant(&self, name: &str, limits: Value) -> (String, String) {
        let t = self.admin("POST", "/admin/tenants", Some(json!({"name": name, "limits": limits})));
        assert_eq!(t.status, 201, "{}", t.text());
        let id = t.json()["id"].as_str().unwrap().to_string();
        let k = self.admin("POST", &format!("/admin/tenants/{id}/keys"), None);
        assert_eq!(k.status, 201, "{}", k.text());
        (id, k.json()["key"].as_str().unwrap().to_string())
    }

    pub fn upload(&self, key: &str, name: &str, config: &[u8], weights: &[u8]) -> Response {
        let (ctype, body) = multipart(&[("name", name.as_bytes()), ("config", config), ("weights", weights)]);
        self.http.send(&Request::new("POST", "/v1/adapters").key(key).body(&ctype, &body)).unwrap()
    }

    pub fn complete(&self, key: &str, model: &str, max_tokens: u32) -> Response {
        self.call(Some(key), "POST", "/v1/completions", Some(json!({"model": model, "prompt": "hello", "max_tokens": max_tokens, "temperature": 0})))
    }

    /// Runs `sql` against the server's database; every row as strings.
    pub fn query(&self, sql: &str) -> Vec<Vec<String>> {
        use sqlx::Row;
        sqlx::any::install_default_drivers();
        block_on(async {
            let pool = sqlx::any::AnyPoolOptions::new().max_connections(1).connect(&self.db_url).await.unwrap();
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql.to_string())).fetch_all(&pool).await.unwrap();
            let out = rows
                .iter()
                .map(|r| {
                    (0..r.columns().len())
                        .map(|i| {
                            r.try_get::<String, _>(i)
                                .or_else(|_| r.try_get::<i64, _>(i).map(|v| v.to_string()))
                                .or_else(|_| r.try_get::<f64, _>(i).map(|v| v.to_string()))
                                .unwrap_or_else(|_| "NULL".into())
                        })
                        .collect()
                })
                .collect();
            pool.close().await;
            out
        })
    }

    /// Waits until `cond` holds (or panics after `secs`).
    pub fn wait_for(&self, what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(secs);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The files of `count` small valid adapters for the synthetic tiny model: (config, weights).
pub fn adapter_files(count: usize, seed: u64) -> Vec<(Vec<u8>, Vec<u8>)> {
    use loraplex::synth::{AdapterSynthOptions, AdapterTargets, FileDType, Preset, synthesize_adapters};
    let dir = tempfile::tempdir().unwrap();
    let dirs = synthesize_adapters(&AdapterSynthOptions {
        out: dir.path().to_path_buf(),
        dims: Preset::Tiny.dims(),
        count,
        ranks: vec![8],
        targets: AdapterTargets::Qv,
        seed,
        dtype: FileDType::F32,
    })
    .unwrap();
    dirs.iter().map(|d| (std::fs::read(d.join("adapter_config.json")).unwrap(), std::fs::read(d.join("adapter_model.safetensors")).unwrap())).collect()
}

/// A table of cases: each is one request and what it must get. Failures are collected, so
/// one run reports every case that broke.
#[derive(Default)]
pub struct Cases {
    pub run: usize,
    pub failed: Vec<String>,
}

impl Cases {
    /// Checks a response: its status, and that its body contains `needle`.
    pub fn check(&mut self, name: &str, res: &Response, status: u16, needle: &str) {
        self.run += 1;
        let text = res.text();
        if res.status != status || !text.contains(needle) {
            self.failed.push(format!("{name}: got {} {text:.300}, expected {status} with {needle:?}", res.status));
        }
        if res.status >= 500 && status < 500 {
            self.failed.push(format!("{name}: a server error"));
        }
    }

    /// Records a boolean case.
    pub fn ok(&mut self, name: &str, ok: bool, detail: impl std::fmt::Display) {
        self.run += 1;
        if !ok {
            self.failed.push(format!("{name}: {detail}"));
        }
    }

    pub fn finish(self, suite: &str) -> usize {
        eprintln!("{suite}: {} cases, {} failed", self.run, self.failed.len());
        assert!(self.failed.is_empty(), "{suite}: {} of {} cases failed:\n{}", self.failed.len(), self.run, self.failed.join("\n"));
        self.run
    }
}
