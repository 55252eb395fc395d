//! A small HTTP/1.1 client over `std::net::TcpStream`, for load generators and black-box tests
//! that must control the connection itself: send part of a body and stall, hang up in the
//! middle of a stream, time each server-sent event as it arrives. One request per connection
//! (`Connection: close`), or many over one kept alive ([`KeepAlive`], for load generators, which
//! should not spend the machine's CPU on a TCP handshake per request); chunked and sized bodies
//! are read.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A response read to its end.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    /// Header names in lowercase.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The body as JSON, or as a JSON string when it is not JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| Value::String(self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `data:` payloads of a server-sent event stream (`[DONE]` as a string).
    pub fn events(&self) -> Vec<Value> {
        self.text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(|d| serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.to_string())))
            .collect()
    }
}

/// A server's address and the defaults of its requests.
#[derive(Debug, Clone)]
pub struct Client {
    pub addr: String,
    /// How long a read may wait before the request fails.
    pub timeout: Duration,
}

/// What to send.
#[derive(Debug, Clone, Default)]
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub key: Option<&'a str>,
    pub content_type: Option<&'a str>,
    pub body: &'a [u8],
}

impl<'a> Request<'a> {
    pub fn new(method: &'a str, path: &'a str) -> Self {
        Self { method, path, ..Self::default() }
    }

    pub fn key(self, key: &'a str) -> Self {
        Self { key: Some(key), ..self }
    }

    pub fn body(self, content_type: &'a str, body: &'a [u8]) -> Self {
        Self { content_type: Some(content_type), body, ..self }
    }
}

/// Reads an HTTP response from `reader`: the status line and headers.
fn read_head(reader: &mut impl BufRead) -> std::io::Result<(u16, Vec<(String, String)>)> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the server closed the connection without answering"));
    }
    let status = line.split(' ').nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad("not an HTTP status line"))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        reader.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (name, value) = l.split_once(':').ok_or_else(|| bad("a malformed header"))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    Ok((status, headers))
}

/// The body's bytes as they come, de-chunked: calls `on_data` with each piece; stops early
/// when it returns false.
fn read_body(reader: &mut impl BufRead, headers: &[(String, String)], mut on_data: impl FnMut(&[u8]) -> bool) -> std::io::Result<()> {
    let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    if chunked {
        let mut line = String::new();
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                return Ok(());
            }
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16)
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "a malformed chunk size"))?;
            if size == 0 {
                // The trailer, up to its empty line: the connection may carry another response.
                loop {
                    line.clear();
                    if reader.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
                        return Ok(());
                    }
                }
            }
            let mut data = vec![0; size];
            reader.read_exact(&mut data)?;
            let mut crlf = [0; 2];
            reader.read_exact(&mut crlf)?;
            if !on_data(&data) {
                return Ok(());
            }
        }
    }
    let length = headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse::<u64>().ok());
    let mut buf = [0u8; 8192];
    let mut left = length.unwrap_or(u64::MAX);
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = reader.read(&mut buf[..want])?;
        if n == 0 {
            break;
        }
        left -= n as u64;
        if !on_data(&buf[..n]) {
            break;
        }
    }
    Ok(())
}

/// Writes a request's body. A server may answer before it has read the body (a refusal) and
/// stop reading: the write then fails, and the answer is still there to read, as common HTTP
/// clients do. Other failures are errors.
fn write_body(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    match s.write_all(body) {
        Err(e) if matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset) => Ok(()),
        other => other,
    }
}

/// The whole response on `s`.
pub fn read_response(s: TcpStream) -> std::io::Result<Response> {
    read_whole(&mut BufReader::new(s))
}

/// The next whole response from `reader`, its body read to its end.
fn read_whole(reader: &mut impl BufRead) -> std::io::Result<Response> {
    let (status, headers) = read_head(reader)?;
    let mut body = Vec::new();
    read_body(reader, &headers, |d| {
        body.extend_from_slice(d);
        true
    })?;
    Ok(Response { status, headers, body })
}

impl Client {
    pub fn new(addr: impl Into<String>) -> Self {
        Self { addr: addr.into(), timeout: Duration::from_secs(120) }
    }

    fn connect(&self) -> std::io::Result<TcpStream> {
        let s = TcpStream::connect(&self.addr)?;
        s.set_read_timeout(Some(self.timeout))?;
        s.set_nodelay(true)?;
        Ok(s)
    }

    /// A connection with the request's head written (and `Content-Length` set to the body's
    /// full length) but no body yet: for callers that send the body themselves, or never.
    pub fn open(&self, req: &Request<'_>) -> std::io::Result<TcpStream> {
        let mut s = self.connect()?;
        write_head(&mut s, req, false)?;
        Ok(s)
    }

    /// Writes `bytes` as they are (a hand-made request) and reads the response.
    pub fn raw(&self, bytes: &[u8]) -> std::io::Result<Response> {
        let mut s = self.connect()?;
        s.write_all(bytes)?;
        read_response(s)
    }

    /// Sends a request and reads the whole response.
    pub fn send(&self, req: &Request<'_>) -> std::io::Result<Response> {
        let mut s = self.open(req)?;
        write_body(&mut s, req.body)?;
        read_response(s)
    }

    /// A JSON request (`body` `None`: no body).
    pub fn json(&self, method: &str, path: &str, key: Option<&str>, body: Option<&Value>) -> std::io::Result<Response> {
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        self.send(&json_request(method, path, key, body.map(|_| bytes.as_bytes())))
    }

    /// Sends a request whose answer is a stream of server-sent events, calling `on_event` with
    /// each `data:` payload and the moment it arrived; returning false from it hangs up there.
    /// Returns the status and the headers.
    pub fn stream(&self, req: &Request<'_>, mut on_event: impl FnMut(&str, Instant) -> bool) -> std::io::Result<(u16, Vec<(String, String)>)> {
        let mut s = self.open(req)?;
        write_body(&mut s, req.body)?;
        let mut reader = BufReader::new(s);
        let (status, headers) = read_head(&mut reader)?;
        let mut pending = Vec::new();
        read_body(&mut reader, &headers, |d| {
            pending.extend_from_slice(d);
            let now = Instant::now();
            while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = pending.drain(..end + 2).collect();
                let text = String::from_utf8_lossy(&event[..end]);
                if let Some(data) = text.strip_prefix("data: ")
                    && !on_event(data, now)
                {
                    return false;
                }
            }
            true
        })?;
        Ok((status, headers))
    }
}

/// The request's head: `Content-Length` set to the body's full length; the connection closed
/// after the response, or kept for the next request.
fn write_head(s: &mut TcpStream, req: &Request<'_>, keep_alive: bool) -> std::io::Result<()> {
    let auth = req.key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    let ctype = req.content_type.map(|c| format!("Content-Type: {c}\r\n")).unwrap_or_default();
    let connection = if keep_alive { "keep-alive" } else { "close" };
    // One write for the head: a small first packet of its own would wait on the server's
    // delayed acknowledgement before the body could follow.
    let head = format!(
        "{} {} HTTP/1.1\r\nHost: loraplex\r\nConnection: {connection}\r\n{auth}{ctype}Content-Length: {}\r\n\r\n",
        req.method,
        req.path,
        req.body.len()
    );
    s.write_all(head.as_bytes())
}

fn json_request<'a>(method: &'a str, path: &'a str, key: Option<&'a str>, body: Option<&'a [u8]>) -> Request<'a> {
    let req = Request { method, path, key, ..Request::default() };
    match body {
        Some(b) => req.body("application/json", b),
        None => req,
    }
}

/// Requests over one connection kept alive between them, opened on first use and again after
/// the server closes it. A request sent on a connection that turns out to have been closed
/// while idle (the server answers nothing at all) is sent once more on a fresh one; any other
/// failure is the request's, and the connection is dropped.
pub struct KeepAlive {
    client: Client,
    conn: Option<BufReader<TcpStream>>,
    /// Connections opened so far.
    pub opened: u64,
}

impl KeepAlive {
    pub fn new(client: Client) -> Self {
        Self { client, conn: None, opened: 0 }
    }

    /// Sends a request and reads the whole response.
    pub fn send(&mut self, req: &Request<'_>) -> std::io::Result<Response> {
        let reused = self.conn.is_some();
        match self.exchange(req) {
            Err(e)
                if reused && matches!(e.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe) =>
            {
                self.conn = None;
                self.exchange(req)
            }
            other => other,
        }
    }

    /// A JSON request (`body` `None`: no body).
    pub fn json(&mut self, method: &str, path: &str, key: Option<&str>, body: Option<&Value>) -> std::io::Result<Response> {
        let bytes = body.map(|b| b.to_string()).unwrap_or_default();
        self.send(&json_request(method, path, key, body.map(|_| bytes.as_bytes())))
    }

    fn exchange(&mut self, req: &Request<'_>) -> std::io::Result<Response> {
        let mut reader = match self.conn.take() {
            Some(r) => r,
            None => {
                self.opened += 1;
                BufReader::new(self.client.connect()?)
            }
        };
        let s = reader.get_mut();
        write_head(s, req, true)?;
        write_body(s, req.body)?;
        let response = read_whole(&mut reader)?;
        let sized = response.header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) || response.header("content-length").is_some();
        let closing = response.header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"));
        // A body that ran to the connection's end leaves nothing to reuse.
        if sized && !closing {
            self.conn = Some(reader);
        }
        Ok(response)
    }
}

/// A `multipart/form-data` body of `(name, bytes)` fields: its content type and bytes.
pub fn multipart(fields: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    const BOUNDARY: &str = "loraplex-form-boundary-7f3a";
    let mut out = Vec::new();
    for (name, bytes) in fields {
        out.extend_from_slice(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n")
                .as_bytes(),
        );
        out.extend_from_slice(bytes);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={BOUNDARY}"), out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::io::Read;
    use std::net::TcpListener;

    /// Reads one request (head and sized body) from `r`; None at the connection's end.
    fn read_request(r: &mut BufReader<TcpStream>) -> Option<(String, Vec<u8>)> {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let first = line.trim_end().to_string();
        let mut length = 0;
        loop {
            line.clear();
            r.read_line(&mut line).ok()?;
            if line.trim_end().is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().ok()?;
            }
        }
        let mut body = vec![0; length];
        r.read_exact(&mut body).ok()?;
        Some((first, body))
    }

    /// One connection kept for a sized and a chunked response (its trailer read), a fresh one
    /// after the server says it closes, and a request that finds its idle connection closed
    /// is sent again on a new one.
    #[test]
    fn keep_alive_reuses_the_connection_until_the_server_closes_it() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let mut seen = Vec::new();
            // Connection 1: a sized answer, a chunked one with a trailer, then one that closes.
            let (s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s);
            let (line, body) = read_request(&mut r).unwrap();
            seen.push((1, line, body));
            r.get_mut().write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst").unwrap();
            let (line, body) = read_request(&mut r).unwrap();
            seen.push((1, line, body));
            r.get_mut().write_all(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nsec\r\n3\r\nond\r\n0\r\nX-Trailer: 1\r\n\r\n").unwrap();
            let (line, body) = read_request(&mut r).unwrap();
            seen.push((1, line, body));
            r.get_mut().write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 5\r\n\r\nthird").unwrap();
            drop(r);
            // Connection 2: one answer, then closed while idle, without a word.
            let (s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s);
            let (line, body) = read_request(&mut r).unwrap();
            seen.push((2, line, body));
            r.get_mut().write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nfourth").unwrap();
            r.get_mut().shutdown(std::net::Shutdown::Both).unwrap();
            drop(r);
            // Connection 3: the request that found connection 2 closed, sent again.
            let (s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s);
            let (line, body) = read_request(&mut r).unwrap();
            seen.push((3, line, body));
            r.get_mut().write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfifth").unwrap();
            seen
        });
        let mut conn = KeepAlive::new(Client::new(addr));
        let body = json!({"n": 1});
        let answers: Vec<(u16, String, u64)> = (0..5)
            .map(|i| {
                let r = conn.json("POST", &format!("/r{i}"), Some("key"), Some(&body)).unwrap();
                (r.status, r.text(), conn.opened)
            })
            .collect();
        assert_eq!(
            answers,
            vec![(200, "first".into(), 1), (201, "second".into(), 1), (200, "third".into(), 1), (200, "fourth".into(), 2), (200, "fifth".into(), 3)]
        );
        let seen = server.join().unwrap();
        let paths: Vec<(i32, &str)> = seen.iter().map(|(c, line, _)| (*c, line.as_str())).collect();
        assert_eq!(
            paths,
            vec![(1, "POST /r0 HTTP/1.1"), (1, "POST /r1 HTTP/1.1"), (1, "POST /r2 HTTP/1.1"), (2, "POST /r3 HTTP/1.1"), (3, "POST /r4 HTTP/1.1")]
        );
        assert!(seen.iter().all(|(_, _, b)| b == br#"{"n":1}"#), "every body sent whole");
    }
}
