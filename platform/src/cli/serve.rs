//! `loraplex serve`: the HTTP server on the embedded defaults (SQLite under the data
//! directory). So far it serves health, readiness and the admin API; SIGINT or SIGTERM stop it
//! gracefully, letting requests in flight finish.

use anyhow::Context;
use actix_web::{App, HttpServer, web};

use crate::api::{self, AppState};
use crate::config::ServeArgs;
use crate::store::Store;

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("creating the data directory {}", args.data_dir.display()))?;
    let url = match &args.database_url {
        Some(url) => url.clone(),
        None => format!("sqlite://{}", args.data_dir.join("loraplex.db").display()),
    };
    actix_web::rt::System::new().block_on(async move {
        let store = Store::connect(&url).await.with_context(|| format!("opening the database {url}"))?;
        match &args.admin_key {
            Some(key) => {
                store.ensure_admin_key(key).await?;
            }
            None if !store.has_admin_key().await? => {
                let (_, secret) = store.create_key(None, &[crate::store::Scope::Admin]).await?;
                println!("admin key (shown once; keep it): {secret}");
            }
            None => {}
        }
        let state = AppState { store: store.clone() };
        let server = HttpServer::new(move || App::new().app_data(web::Data::new(state.clone())).configure(api::routes))
            .bind((args.host.as_str(), args.port))
            .with_context(|| format!("listening on {}:{}", args.host, args.port))?;
        for addr in server.addrs() {
            println!("listening on http://{addr}");
        }
        use std::io::Write;
        std::io::stdout().flush()?;
        server.run().await?;
        store.close().await;
        anyhow::Ok(())
    })
}
