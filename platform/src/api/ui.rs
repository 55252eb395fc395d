//! The admin console: the files of `admin-ui/`, embedded in the binary at compile time, served
//! at `/ui/`; `/` and `/ui` redirect there. The console is plain ES modules that call the public
//! REST API with the key its user signs in with, so nothing here knows about tenants or keys.
//!
//! Every file goes out with a Content-Security-Policy that allows scripts, styles and requests
//! from this origin only (no inline script, no `eval`, no framing), `nosniff`, and an ETag of
//! its content so a browser revalidates instead of downloading again.

use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpRequest, HttpResponse, web};
use rust_embed::Embed;

use super::error::ApiError;

#[derive(Embed)]
#[folder = "../admin-ui/"]
#[exclude = "*.d.ts"]
struct Console;

/// What a console page may load and run.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
     connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/", web::get().to(to_console)).route("/ui", web::get().to(to_console)).route("/ui/{path:.*}", web::get().to(file));
}

async fn to_console() -> HttpResponse {
    HttpResponse::Found().insert_header((header::LOCATION, "/ui/")).finish()
}

/// One file of the console (`index.html` for `/ui/`).
async fn file(req: HttpRequest, path: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let path = path.into_inner();
    let name = if path.is_empty() { "index.html" } else { path.as_str() };
    let found = Console::get(name).ok_or_else(|| ApiError::NotFound(format!("console file {name:?}")))?;
    let etag = format!("\"{}\"", crate::store::hex(&found.metadata.sha256_hash()[..16]));
    let fresh = req.headers().get(header::IF_NONE_MATCH).is_some_and(|v| v.as_bytes() == etag.as_bytes());
    let mut res = if fresh { HttpResponse::NotModified() } else { HttpResponse::Ok() };
    let mime = found.metadata.mimetype();
    let content_type = if mime.starts_with("text/") || mime == "application/javascript" { format!("{mime}; charset=utf-8") } else { mime.to_string() };
    res.insert_header((header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY)))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"))
        .insert_header((header::X_FRAME_OPTIONS, "DENY"))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header((header::ETAG, etag));
    if fresh {
        return Ok(res.finish());
    }
    Ok(res.content_type(content_type).body(found.data.into_owned()))
}

/// Every embedded file's path (for the tests).
#[cfg(test)]
pub fn files() -> Vec<String> {
    Console::iter().map(|p| p.into_owned()).collect()
}

#[cfg(test)]
mod tests {
    use actix_web::http::{StatusCode, header};
    use actix_web::test::{TestRequest, call_service, init_service, read_body};
    use actix_web::{App, web};

    use super::*;

    #[actix_web::test]
    async fn the_console_is_served_with_its_policy_and_the_root_leads_to_it() {
        let app = init_service(App::new().app_data(web::PathConfig::default()).configure(routes)).await;
        for from in ["/", "/ui"] {
            let res = call_service(&app, TestRequest::get().uri(from).to_request()).await;
            assert_eq!(res.status(), StatusCode::FOUND, "{from}");
            assert_eq!(res.headers().get(header::LOCATION).unwrap(), "/ui/");
        }
        let res = call_service(&app, TestRequest::get().uri("/ui/").to_request()).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers().get(header::CONTENT_TYPE).unwrap(), "text/html; charset=utf-8");
        assert_eq!(res.headers().get(header::CONTENT_SECURITY_POLICY).unwrap(), CONTENT_SECURITY_POLICY);
        assert_eq!(res.headers().get(header::X_CONTENT_TYPE_OPTIONS).unwrap(), "nosniff");
        let etag = res.headers().get(header::ETAG).unwrap().clone();
        let page = String::from_utf8(read_body(res).await.to_vec()).unwrap();
        assert!(page.contains(r#"<script type="module" src="./app.js"></script>"#), "{page}");
        assert!(!page.contains("<script>"), "no inline script");
        // Revalidation with the ETag costs no body.
        let res = call_service(&app, TestRequest::get().uri("/ui/").insert_header((header::IF_NONE_MATCH, etag)).to_request()).await;
        assert_eq!(res.status(), StatusCode::NOT_MODIFIED);
        assert!(read_body(res).await.is_empty());
        let res = call_service(&app, TestRequest::get().uri("/ui/app.js").to_request()).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers().get(header::CONTENT_TYPE).unwrap(), "text/javascript; charset=utf-8");
        let res = call_service(&app, TestRequest::get().uri("/ui/vendor/preact-htm.js").to_request()).await;
        assert_eq!(res.status(), StatusCode::OK);
        for missing in ["/ui/nope.js", "/ui/../Cargo.toml", "/ui/vendor/preact-htm.d.ts", "/ui/%2e%2e/Cargo.toml"] {
            let res = call_service(&app, TestRequest::get().uri(missing).to_request()).await;
            assert_eq!(res.status(), StatusCode::NOT_FOUND, "{missing}");
        }
    }

    #[test]
    fn the_console_scripts_and_styles_stay_small() {
        let total: usize = files().iter().filter(|f| f.ends_with(".js") || f.ends_with(".css")).map(|f| Console::get(f).unwrap().data.len()).sum();
        assert!(total < 300 * 1024, "the console's JavaScript and CSS are {total} bytes");
        assert!(files().iter().all(|f| !f.ends_with(".d.ts")));
    }
}
