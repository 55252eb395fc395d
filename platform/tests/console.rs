//! The admin console in a real browser: `tests/ui/e2e.mjs` (Playwright driving headless
//! Chromium) against `loraplex serve` on the embedded defaults. It needs `npm ci` in `tests/ui`
//! and Debian's `chromium`, which `.ci/run` installs; elsewhere the test says it is skipped,
//! unless `LORAPLEX_REQUIRE_CONSOLE` is set.

use std::path::Path;
use std::process::Command;

use loraplex::bench::server::Server;

#[test]
fn the_console_works_in_a_browser() {
    let ui = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/ui");
    let chromium = std::env::var("LORAPLEX_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let ready = ui.join("node_modules/playwright-core").is_dir() && Path::new(&chromium).exists();
    if !ready {
        assert!(std::env::var_os("LORAPLEX_REQUIRE_CONSOLE").is_none(), "LORAPLEX_REQUIRE_CONSOLE is set but tests/ui/node_modules or {chromium} is missing");
        eprintln!("the console browser test is skipped: run `npm ci` in tests/ui and install chromium (.ci/run does both)");
        return;
    }
    let data = tempfile::tempdir().unwrap();
    let synth = data.path().join("synth");
    let made = Command::new(env!("CARGO_BIN_EXE_loraplex"))
        .args(["synth", "--preset", "tiny", "--adapters", "1", "--ranks", "8", "--targets", "qv", "--out"])
        .arg(&synth)
        .output()
        .unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let adapter = std::fs::read_dir(synth.join("adapters")).unwrap().next().unwrap().unwrap().path();
    let admin = "operator-key-0123456789";
    let server = Server::start(Path::new(env!("CARGO_BIN_EXE_loraplex")), &data.path().join("server"), &["--admin-key", admin]).unwrap();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console");
    let run = Command::new("node")
        .current_dir(&ui)
        .env("LORAPLEX_CHROMIUM", &chromium)
        .arg("e2e.mjs")
        .arg(format!("http://{}", server.addr))
        .arg(admin)
        .arg(&out)
        .arg(&adapter)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("console e2e: ok"), "{stdout}");
    eprintln!("{stdout}screenshots: {}", out.display());
}
