//! Whether a request's client is still there.
//!
//! actix-web does not tell a handler that its client closed the connection while the handler
//! is working on a response (actix/actix-web#3462): a non-streaming completion would run to its
//! end for nobody, and a stream still waiting for its first token would not notice either. So
//! each connection keeps a duplicate of its socket (taken when the connection is accepted) and
//! a request can look at it: the peer has gone when a non-consuming read sees the end of the
//! stream or an error. Peeking never takes bytes from the connection, so HTTP parsing is not
//! affected. A request that waits on its client registers one more duplicate with the reactor,
//! so the client's FIN or reset wakes it at once: the work of a request whose client left stops
//! within the step that is running, not at the next look.
//!
//! The same socket lets a refusal cost nothing in proportion to the body it refuses. A request
//! refused before its body was read (no key, over a limit, a server full) leaves the rest of the
//! body on its way; the HTTP layer would read and discard it so that the client can read the
//! answer, which costs the server as much as accepting the body would. [`shed_refused_bodies`]
//! instead stops reading the connection: the answer is still written and the connection closed,
//! and the kernel drops whatever more the client sends (Linux keeps the answer readable for the
//! client even as its writes of the body start to fail; common HTTP clients read it then).

use std::time::Duration;

use actix_web::HttpRequest;
use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{ConnectionType, header};
use actix_web::middleware::Next;

/// How often a waiting request looks at its connection where the reactor cannot watch it.
const POLL: Duration = Duration::from_millis(100);

/// The client's side of a request's connection; `None` when it cannot be watched (tests in
/// process, non-Unix systems), which reads as always there.
#[derive(Clone, Debug, Default)]
pub struct Peer(Option<std::sync::Arc<Watch>>);

/// A request's view of its connection.
#[derive(Debug)]
struct Watch {
    socket: std::sync::Arc<std::net::TcpStream>,
    /// Registered with the reactor on the first wait (`None`: it could not be; polled then).
    ready: std::sync::OnceLock<Option<tokio::net::TcpStream>>,
}

/// Stored in each connection's data by [`on_connect`].
#[derive(Clone, Debug)]
struct Watched(std::sync::Arc<std::net::TcpStream>);

/// For `HttpServer::on_connect`: keeps a duplicate of the connection's socket.
pub fn on_connect(conn: &dyn std::any::Any, data: &mut actix_web::dev::Extensions) {
    #[cfg(unix)]
    if let Some(tcp) = conn.downcast_ref::<actix_web::rt::net::TcpStream>() {
        use std::os::fd::AsFd;
        // A second descriptor of the same (already non-blocking) socket.
        if let Ok(fd) = tcp.as_fd().try_clone_to_owned() {
            data.insert(Watched(std::sync::Arc::new(std::net::TcpStream::from(fd))));
        }
    }
    #[cfg(not(unix))]
    let _ = (conn, data);
}

impl Peer {
    pub fn of(req: &HttpRequest) -> Self {
        Peer(req.conn_data::<Watched>().map(|w| std::sync::Arc::new(Watch { socket: w.0.clone(), ready: std::sync::OnceLock::new() })))
    }

    /// Watches a connection of its own (the tests').
    #[cfg(test)]
    fn watching(socket: std::net::TcpStream) -> Self {
        Peer(Some(std::sync::Arc::new(Watch { socket: std::sync::Arc::new(socket), ready: std::sync::OnceLock::new() })))
    }

    /// True once the client has closed its side of the connection or it broke.
    pub fn gone(&self) -> bool {
        let Some(watch) = &self.0 else { return false };
        let mut byte = [0u8; 1];
        match watch.socket.peek(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::Interrupted => false,
            Err(_) => true,
        }
    }

    /// Stops reading the connection: what the client sends from now on is dropped, what it has
    /// sent and the server has not read yet ends the request stream, and the connection closes
    /// once the response is written. Writing is not affected.
    pub fn stop_reading(&self) {
        if let Some(watch) = &self.0 {
            // Fails only if the connection is already gone, which is what was wanted.
            let _ = watch.socket.shutdown(std::net::Shutdown::Read);
        }
    }

    /// Completes when the client has gone; never, for a peer that cannot be watched.
    pub async fn closed(&self) {
        let Some(watch) = &self.0 else { return std::future::pending().await };
        if let Some(stream) = watch.registered() {
            loop {
                if self.gone() {
                    return;
                }
                // Readable: bytes came (a pipelined request: not an end), or the client's FIN or
                // a reset did. Unless it was an end, the readiness is cleared (by answering "would
                // block" for it), and a later event wakes this again.
                if stream.readable().await.is_err() {
                    // The reactor cannot watch it after all: looked at as below.
                    break;
                }
                if self.gone() {
                    return;
                }
                let _ = stream.try_io(tokio::io::Interest::READABLE, || Err::<(), _>(std::io::ErrorKind::WouldBlock.into()));
            }
        }
        loop {
            if self.gone() {
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Watch {
    /// The connection registered with this thread's reactor for readiness, on the first call;
    /// `None` outside a runtime, or when it cannot be registered.
    fn registered(&self) -> Option<&tokio::net::TcpStream> {
        self.ready
            .get_or_init(|| {
                tokio::runtime::Handle::try_current().ok()?;
                // One more descriptor of the same socket, owned by the reactor's stream.
                tokio::net::TcpStream::from_std(self.socket.try_clone().ok()?).ok()
            })
            .as_ref()
    }
}

/// Bodies declared at least this large are not read to their end after an error response.
pub const SHED_BODY_BYTES: u64 = 64 << 10;

/// Middleware: an error response to a request with a large body (declared at least
/// [`SHED_BODY_BYTES`], or chunked, whose size nobody knows ahead) closes its connection without
/// reading the rest of the body; see the module's documentation. Smaller bodies are read to
/// their end as usual, and keep their connection when they were read before the answer.
pub async fn shed_refused_bodies(req: ServiceRequest, next: Next<impl MessageBody>) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let large = match req.headers().get(header::CONTENT_LENGTH) {
        Some(v) => v.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()).is_none_or(|n| n >= SHED_BODY_BYTES),
        None => req.headers().get(header::TRANSFER_ENCODING).is_some(),
    };
    let peer = if large { Some(Peer::of(req.request())) } else { None };
    let mut res = next.call(req).await.inspect_err(|_| {
        if let Some(peer) = &peer {
            peer.stop_reading();
        }
    })?;
    if let Some(peer) = peer
        && (res.status().is_client_error() || res.status().is_server_error())
    {
        res.response_mut().head_mut().set_connection_type(ConnectionType::Close);
        peer.stop_reading();
    }
    Ok(res)
}

/// The longest `x-request-id` a client may set (a longer or unprintable one is replaced).
const MAX_REQUEST_ID: usize = 128;

/// Middleware: every response carries `x-request-id`: the client's own, when it sent a short
/// printable one, else a new id; a proxy's or client's logs and the server's then name the same
/// request.
pub async fn request_id(req: ServiceRequest, next: Next<impl MessageBody>) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let sent = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= MAX_REQUEST_ID && v.bytes().all(|b| b.is_ascii_graphic()));
    let id = match sent {
        Some(v) => header::HeaderValue::from_str(v).ok(),
        None => None,
    }
    .or_else(|| header::HeaderValue::from_str(&crate::store::random_id("req")).ok());
    // A handler's error is a response here already (actix renders it inside the route).
    let mut res = next.call(req).await?;
    if let Some(id) = id {
        res.headers_mut().insert(header::HeaderName::from_static("x-request-id"), id);
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock stands still unless a timer is all that is left to wait for: a wait that the
    /// connection itself ends takes no time on it, one that looks at the connection now and
    /// then takes a look's interval at least.
    #[tokio::test(start_paused = true)]
    async fn a_waiting_request_wakes_when_its_client_leaves_not_at_the_next_look() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        server.set_nonblocking(true).unwrap();
        let peer = Peer::watching(server);
        assert!(!peer.gone());
        let start = tokio::time::Instant::now();
        let leaving = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(client);
        });
        peer.closed().await;
        assert_eq!(start.elapsed(), Duration::ZERO, "woken by a timer, not by the connection");
        assert!(peer.gone());
        leaving.join().unwrap();
        // A clone shares the registration, and sees the end at once.
        peer.clone().closed().await;
    }
}
