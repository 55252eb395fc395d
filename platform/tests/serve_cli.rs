//! `loraplex serve` on the embedded defaults: first start prints the admin key once, the
//! server answers health and the admin API, and a restart keeps the database.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

struct Server {
    child: Child,
    addr: String,
    admin: Option<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(data: &std::path::Path, extra: &[&str]) -> Server {
    let child = Command::new(env!("CARGO_BIN_EXE_loraplex"))
        .args(["serve", "--port", "0", "--data-dir"])
        .arg(data)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Owned by the guard at once, so the process is reaped on every path.
    let mut server = Server { child, addr: String::new(), admin: None };
    let stdout = server.child.stdout.take().unwrap();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(key) = line.strip_prefix("admin key (shown once; keep it): ") {
            server.admin = Some(key.to_string());
        }
        if let Some(addr) = line.strip_prefix("listening on http://") {
            server.addr = addr.to_string();
            return server;
        }
    }
    panic!("the server exited before printing its address");
}

/// One HTTP/1.1 request; the status and the body.
fn http(addr: &str, method: &str, path: &str, key: Option<&str>, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).unwrap().parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

#[test]
fn serve_prints_the_admin_key_once_and_keeps_its_database() {
    let data = tempfile::tempdir().unwrap();
    let first = start(data.path(), &[]);
    let admin = first.admin.clone().expect("the first start prints an admin key");
    assert_eq!(http(&first.addr, "GET", "/health", None, "").0, 200);
    assert_eq!(http(&first.addr, "GET", "/admin/tenants", None, "").0, 401);
    let (status, body) = http(&first.addr, "POST", "/admin/tenants", Some(&admin), r#"{"name": "acme"}"#);
    assert_eq!(status, 201, "{body}");
    drop(first);
    assert!(data.path().join("loraplex.db").exists(), "SQLite under the data directory by default");

    let second = start(data.path(), &[]);
    assert!(second.admin.is_none(), "the key is printed only once");
    let (status, body) = http(&second.addr, "GET", "/admin/tenants", Some(&admin), "");
    assert_eq!(status, 200);
    assert!(body.contains("\"acme\""), "{body}");
    drop(second);

    let third = start(data.path(), &["--admin-key", "operator-key-0123456789"]);
    assert_eq!(http(&third.addr, "GET", "/admin/tenants", Some("operator-key-0123456789"), "").0, 200);
    assert_eq!(http(&third.addr, "GET", "/ready", None, "").0, 200);
}
