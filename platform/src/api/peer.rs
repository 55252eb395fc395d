//! Whether a request's client is still there.
//!
//! actix-web does not tell a handler that its client closed the connection while the handler
//! is working on a response (actix/actix-web#3462): a non-streaming completion would run to its
//! end for nobody, and a stream still waiting for its first token would not notice either. So
//! each connection keeps a duplicate of its socket (taken when the connection is accepted) and
//! a request can look at it: the peer has gone when a non-consuming read sees the end of the
//! stream or an error. Peeking never takes bytes from the connection, so HTTP parsing is not
//! affected.

use std::time::Duration;

use actix_web::HttpRequest;

/// How often a waiting request looks at its connection.
const POLL: Duration = Duration::from_millis(100);

/// The client's side of a request's connection; `None` when it cannot be watched (tests in
/// process, non-Unix systems), which reads as always there.
#[derive(Clone, Debug, Default)]
pub struct Peer(Option<std::sync::Arc<std::net::TcpStream>>);

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
        Peer(req.conn_data::<Watched>().map(|w| w.0.clone()))
    }

    /// True once the client has closed its side of the connection or it broke.
    pub fn gone(&self) -> bool {
        let Some(socket) = &self.0 else { return false };
        let mut byte = [0u8; 1];
        match socket.peek(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::Interrupted => false,
            Err(_) => true,
        }
    }

    /// Completes when the client has gone; never, for a peer that cannot be watched.
    pub async fn closed(&self) {
        if self.0.is_none() {
            return std::future::pending().await;
        }
        loop {
            if self.gone() {
                return;
            }
            tokio::time::sleep(POLL).await;
        }
    }
}
