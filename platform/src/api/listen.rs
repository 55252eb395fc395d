//! The API's HTTP server.
//!
//! This is what actix-web's `HttpServer` builds (actix-server's builder running actix-http's
//! service over the application), assembled here from those parts for the one thing
//! `HttpServer` cannot be told: how to answer `Expect: 100-continue`. The HTTP layer would tell
//! the client to send its body before any handler ran; here it does so only once the request's
//! key is known, so that a client without a valid key gets its 401 before it sends a byte of
//! its body, and a client that is told to go on is one the server will serve.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::time::Duration;

use actix_http::body::BoxBody;
use actix_http::{HttpMessage, HttpService, Request, Response};
use actix_service::{IntoServiceFactory, ServiceFactoryExt, fn_factory, fn_service, map_config};
use actix_web::dev::{AppConfig, Server};
use actix_web::middleware::from_fn;
use actix_web::{App, ResponseError, web};

use super::{AppState, peer};

/// How long a client may take to send a request's head (as `HttpServer`'s default).
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection being closed may take to go (as `HttpServer`'s default).
const DISCONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Binds every address `host:port` names, as `HttpServer::bind` does: an error only when none
/// of them could be bound.
pub fn bind(host: &str, port: u16) -> std::io::Result<Vec<TcpListener>> {
    let mut bound = Vec::new();
    let mut last = None;
    for addr in (host, port).to_socket_addrs()? {
        match TcpListener::bind(addr) {
            Ok(l) => bound.push(l),
            Err(e) => last = Some(e),
        }
    }
    if bound.is_empty() {
        return Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, format!("{host} names no address"))));
    }
    Ok(bound)
}

/// Where `listeners` listen.
pub fn addresses(listeners: &[TcpListener]) -> Vec<SocketAddr> {
    listeners.iter().filter_map(|l| l.local_addr().ok()).collect()
}

/// The API server on `listeners`, with `workers` HTTP threads (default: one per core); stopping
/// it gracefully waits up to `shutdown_timeout` seconds for the responses in flight. It does not
/// listen for signals: its owner stops it.
pub fn server(state: AppState, listeners: Vec<TcpListener>, workers: Option<usize>, shutdown_timeout: u64) -> std::io::Result<Server> {
    let mut builder = actix_server::Server::build().shutdown_timeout(shutdown_timeout).disable_signals();
    if let Some(n) = workers {
        builder = builder.workers(n.max(1));
    }
    let shutdown = builder.graceful_shutdown_signal();
    for listener in listeners {
        let addr = listener.local_addr()?;
        let (state, shutdown) = (state.clone(), shutdown.clone());
        builder = builder.listen(format!("loraplex-api-{addr}"), listener, move || {
            let (app_state, expect_state, shutdown) = (state.clone(), state.clone(), shutdown.clone());
            let app = App::new()
                .wrap(from_fn(super::shed_refused_bodies))
                .wrap(from_fn(super::request_id))
                .app_data(web::Data::new(app_state))
                .configure(super::routes)
                .into_factory()
                .map_err(|e: actix_web::Error| e.error_response());
            let expect = fn_factory(move || {
                let state = expect_state.clone();
                async move { Ok::<_, ()>(fn_service(move |req: Request| expect_key(state.clone(), req))) }
            });
            HttpService::build()
                .graceful_shutdown_signal(move || {
                    let signal = shutdown.clone();
                    async move { signal.notified().await }
                })
                .client_request_timeout(HEAD_TIMEOUT)
                .client_disconnect_timeout(DISCONNECT_TIMEOUT)
                .local_addr(addr)
                .on_connect_ext(|io: &actix_web::rt::net::TcpStream, data: &mut actix_web::dev::Extensions| peer::on_connect(io, data))
                .expect(expect)
                // The application reads neither the host nor the address of its configuration.
                .finish(map_config(app, |_| AppConfig::default()))
                .tcp()
        })?;
    }
    Ok(builder.run())
}

/// The answer to `Expect: 100-continue`: the request goes on (and the client is told to send
/// its body) when it carries a valid key of any scope (its route checks the scope, as for any
/// request); otherwise the client gets the error it would have got after sending its body, and
/// the connection closes without reading it.
async fn expect_key(state: AppState, req: Request) -> Result<Request, Response<BoxBody>> {
    match super::principal_of(req.headers(), &state).await {
        Ok(_) => Ok(req),
        Err(e) => {
            let mut res: Response<BoxBody> = e.error_response().into();
            res.head_mut().set_connection_type(actix_http::ConnectionType::Close);
            if let Ok(id) = actix_http::header::HeaderValue::from_str(&crate::store::random_id("req")) {
                res.headers_mut().insert(actix_http::header::HeaderName::from_static("x-request-id"), id);
            }
            Err(res)
        }
    }
}
