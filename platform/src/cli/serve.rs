//! `loraplex serve`: the HTTP server. On the embedded defaults it needs nothing: SQLite under
//! the data directory, the CPU backend, and a synthetic tiny model generated on first start
//! when no `--model` is given. SIGINT (Ctrl-C) or SIGTERM stop it gracefully: no new
//! connections, requests in flight finish, their usage rows are committed, then the workers
//! stop. A second one stops it at once (exit status 130).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use actix_web::{App, HttpServer, web};
use anyhow::{Context, bail};
use loraplex_kernels::cuda::CudaBackend;

use crate::api::{self, AdmissionConfig, ApiSettings, AppState, Serving};
use crate::config::{Device, Resolved, ServeArgs};
use crate::model;
use crate::runtime::Runtime;
use crate::store::Store;
use crate::synth::{Preset, SynthOptions};
use crate::tokenizer::Tokenizer;

/// The synthetic model's name.
pub const SYNTHETIC_MODEL: &str = "loraplex-tiny";

/// The command that serves a real model, printed when the synthetic one is served.
pub const REAL_MODEL_HINT: &str = "loraplex serve --model HuggingFaceTB/SmolLM2-135M-Instruct (a hub id, a .gguf file or a model directory)";

/// The model to serve (a directory or a GGUF file) and its name: `--model`, resolved (a hub id
/// fetched into the cache), or the synthetic one in the data directory (written on first
/// start, atomically).
fn model_dir(args: &ServeArgs) -> anyhow::Result<(PathBuf, String)> {
    if let Some(spec) = &args.model {
        let resolved = args.hub.resolve(spec)?;
        return Ok((resolved.files.path().to_path_buf(), resolved.name));
    }
    let dir = args.data_dir.join("model");
    if !dir.join("config.json").is_file() {
        let scratch = args.data_dir.join("model.partial");
        let _ = std::fs::remove_dir_all(&scratch);
        crate::synth::synthesize_model(&SynthOptions {
            out: scratch.clone(),
            preset: Preset::Tiny,
            seed: 0,
            dtype: crate::synth::FileDType::F32,
            kv_heads: None,
        })
        .context("generating the synthetic model")?;
        std::fs::rename(&scratch, &dir).with_context(|| format!("moving the synthetic model to {}", dir.display()))?;
        println!("no --model given: generated a synthetic tiny model in {} (random weights, for trying the API)", dir.display());
    } else {
        println!("no --model given: serving the synthetic tiny model in {}", dir.display());
    }
    println!("for a real model: {REAL_MODEL_HINT}");
    Ok((dir, SYNTHETIC_MODEL.to_string()))
}

/// The engine as `serve` runs it: adapter pins may take their share of each pool.
fn engine_config(args: &ServeArgs, kv: crate::config::KvDType) -> crate::engine::EngineConfig {
    crate::engine::EngineConfig { pinned_percent: args.max_pinned_percent, ..args.engine.engine_config(kv) }
}

fn start_runtime(args: &ServeArgs, dir: &Path) -> anyhow::Result<(Arc<dyn Serving>, Arc<Tokenizer>)> {
    if args.workers == 0 {
        bail!("--workers must be at least 1");
    }
    let probe = match args.device {
        Device::Cpu => Err("not probed".to_string()),
        _ => loraplex_kernels::cuda::probe(),
    };
    let resolved = args.device.resolve(args.workers, probe.clone()).map_err(anyhow::Error::msg)?;
    let tokenizer = Arc::new(Tokenizer::open(dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))?);
    let load = |what: &str| format!("loading the model {} onto {what}", dir.display());
    let serving: Arc<dyn Serving> = match resolved {
        Resolved::Cpu => {
            if let (Device::Auto, Err(why)) = (args.device, &probe) {
                println!("--device auto: using the CPU ({why})");
            }
            let (matmul, kv) = args.engine.dtypes(false).map_err(anyhow::Error::msg)?;
            let backend = matmul.cpu_backend();
            println!("CPU kernels: {}; KV pages in {}", backend.describe(), kv.row_dtype().dtype());
            let model = Arc::new(model::load(Arc::new(backend), dir).with_context(|| load("the CPU"))?);
            let devices = vec![model; args.workers];
            Arc::new(Runtime::start(devices, tokenizer.clone(), engine_config(args, kv)).context("starting the workers")?)
        }
        Resolved::Cuda(ordinals) => {
            let (matmul, kv) = args.engine.dtypes(true).map_err(anyhow::Error::msg)?;
            let compute = matmul.cuda_compute();
            println!("CUDA: computing in {compute}, KV pages in {}", kv.row_dtype().dtype());
            let mut devices = Vec::new();
            for n in ordinals {
                let backend = CudaBackend::open(n, compute).with_context(|| format!("opening cuda:{n} and compiling its kernels"))?;
                devices.push(Arc::new(model::load(Arc::new(backend), dir).with_context(|| load(&format!("cuda:{n}")))?));
            }
            Arc::new(Runtime::start(devices, tokenizer.clone(), engine_config(args, kv)).context("starting the workers")?)
        }
    };
    Ok((serving, tokenizer))
}

/// This server's name on the ledger rows it opens: kept in the data directory, so that a
/// restart finds the rows its previous run left open (and no other replica's).
fn instance_id(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join("instance-id");
    if let Ok(id) = std::fs::read_to_string(&path)
        && !id.trim().is_empty()
    {
        return Ok(id.trim().to_string());
    }
    let id = crate::store::random_id("inst");
    let partial = data_dir.join("instance-id.partial");
    std::fs::write(&partial, &id).and_then(|()| std::fs::rename(&partial, &path)).with_context(|| format!("writing {}", path.display()))?;
    Ok(id)
}

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    crate::config::init_threads(args.engine.threads)?;
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("creating the data directory {}", args.data_dir.display()))?;
    let data_dir = args.data_dir.canonicalize()?;
    let url = match &args.database_url {
        Some(url) => url.clone(),
        None => format!("sqlite://{}", data_dir.join("loraplex.db").display()),
    };
    let (dir, default_name) = model_dir(args)?;
    let model_name = args.served_model_name.clone().unwrap_or(default_name);
    let (serving, tokenizer) = start_runtime(args, &dir)?;
    let settings = ApiSettings {
        max_upload_bytes: args.max_upload_mb.saturating_mul(1 << 20),
        max_running: args.engine.max_running,
        admission: AdmissionConfig { max_pending: args.max_pending.max(1), max_pending_per_tenant: args.max_pending_per_tenant.max(1) },
        blocking_threads: args.blocking_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())).max(1),
        blocking_queue: args.blocking_queue,
        body_timeout: Duration::from_secs(args.body_timeout.max(1)),
        body_min_rate: args.body_min_rate,
        max_uploads_per_key: args.max_uploads_per_key.max(1),
        max_keys_per_tenant: args.max_keys_per_tenant,
        tenant_pinned_percent: args.tenant_pinned_percent,
        instance: instance_id(&data_dir)?,
        open_row_after: Duration::from_millis(args.open_row_after_ms),
        ledger_gather: Duration::from_millis(args.ledger_gather_ms),
        grammar: crate::grammar::GrammarLimits::default(),
        batch: args.batch.settings(),
    };
    // The adapter store's TLS (rustls) uses ring; a provider set earlier stays.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let adapter_files = api::AdapterFiles::open(args.cluster.adapter_store.as_deref(), &data_dir).context("opening the adapter store")?;
    actix_web::rt::System::new().block_on(async move {
        let store = Store::connect(&url).await.with_context(|| format!("opening the database {url}"))?;
        // A generated operator key is made once the server listens (below): a first start that
        // cannot bind its port prints no key, so the next start still makes one.
        let generate_key = match &args.admin_key {
            Some(key) => {
                store.ensure_admin_key(key).await?;
                false
            }
            None => !store.has_admin_key().await?,
        };
        let base = api::BaseModel::new(&model_name, serving.base_shape());
        let adopted = store.adopt_adapters(&base.name, &base.shape).await?;
        if adopted > 0 {
            println!("adapters: {adopted} versions recorded before adapters named their base model are taken to be for `{}`", base.name);
        }
        let other_model = store.all_adapter_versions().await?.iter().filter(|a| base.unusable(a).is_some()).count();
        if other_model > 0 {
            println!("adapters: {other_model} versions were uploaded for another base model and cannot be used with this one (see /admin/adapters)");
        }
        let swept = api::sweep(&data_dir, &store, *serving.base_shape(), *serving.adapter_limits()).await.context("cleaning the data directory")?;
        if swept.orphans + swept.validated > 0 {
            println!("adapter files: kept {}, removed {} orphaned, validated {} from before manifests", swept.kept, swept.orphans, swept.validated);
        }
        // Requests this instance admitted and never finished: its last run died under them.
        let interrupted = store.interrupt_running(&settings.instance).await.context("closing the ledger rows of the last run")?;
        if interrupted > 0 {
            println!("ledger: {interrupted} requests of the last run were interrupted (recorded without charge)");
        }
        let live = store.live_adapter_blobs().await?.into_iter().collect();
        match adapter_files.sweep(&live).await {
            Ok(0) => {}
            Ok(n) => println!("adapter store: removed the objects of {n} versions no record names"),
            Err(e) => eprintln!("warning: cleaning the adapter store: {e}"),
        }
        println!("adapter files: {}", adapter_files.describe());
        let removed = api::batch::sweep(&data_dir, &store).await.context("cleaning the files directory")?;
        if removed > 0 {
            println!("files: removed {removed} that no record names");
        }
        let instance = settings.instance.clone();
        let mut state = AppState::new(store.clone(), serving, tokenizer, &model_name, &data_dir, settings);
        state.adapter_files = Arc::new(adapter_files);
        if store.kind() == crate::store::DbKind::Postgres {
            // Replicas may share this database: tenant limits hold across all of them.
            state.limiter = api::Limiter::shared(store.clone(), &instance).await.context("starting the shared limits")?;
            println!("tenant limits: shared by every replica of this database");
        }
        let listeners = api::listen::bind(&args.host, args.port).with_context(|| format!("listening on {}:{}", args.host, args.port))?;
        let addrs = api::listen::addresses(&listeners);
        if generate_key {
            let (_, secret) = store.create_key(None, &[crate::store::Scope::Admin]).await?;
            println!("admin key (shown once; keep it): {secret}");
        }
        println!("serving `{model_name}` on {}", state.serving.device_name());
        let resumed = api::batch::resume(&state).await.context("resuming the batches of the last run")?;
        if resumed > 0 {
            println!("batches: {resumed} of the last run go on");
        }
        let pins = api::restore_pins(&state).await.context("restoring the pins of the last run")?;
        if pins > 0 {
            println!("pins: restoring {pins} of the last run");
        }
        let metrics_server = match args.cluster.metrics_port {
            Some(port) => {
                let metrics_state = state.clone();
                let server = HttpServer::new(move || App::new().app_data(web::Data::new(metrics_state.clone())).configure(api::metrics_routes))
                    .workers(1)
                    .disable_signals()
                    .shutdown_timeout(1)
                    .bind((args.host.as_str(), port))
                    .with_context(|| format!("listening on {}:{port} for metrics", args.host))?;
                for addr in server.addrs() {
                    println!("metrics (no key) on http://{addr}/metrics");
                }
                let server = server.run();
                let handle = server.handle();
                actix_web::rt::spawn(server);
                Some(handle)
            }
            None => None,
        };
        for addr in addrs {
            println!("listening on http://{addr}");
        }
        api::cluster::watch(state.clone(), Duration::from_millis(args.cluster.cluster_sync_ms));
        use std::io::Write;
        std::io::stdout().flush()?;
        // Both signals drain (see `stop_on_signals`); the server itself listens for none.
        let server = api::listen::server(state.clone(), listeners, args.http_workers, args.shutdown_timeout).context("starting the HTTP server")?;
        actix_web::rt::spawn(stop_on_signals(server.handle()));
        server.await?;
        if let Some(handle) = metrics_server {
            handle.stop(true).await;
        }
        // No batch starts another line; the lines in flight are jobs, and finish below.
        state.batches.shutdown();
        // The server has stopped taking requests and its responses are done; jobs whose
        // clients left early may still be recording their usage.
        if !state.jobs.drain(Duration::from_secs(args.shutdown_timeout)).await {
            eprintln!("warning: {} requests were still running at shutdown", state.jobs.running());
        }
        state.ledger.close().await;
        store.close().await;
        // Whoever started the server may have stopped reading its output.
        let _ = writeln!(std::io::stdout(), "stopped");
        anyhow::Ok(())
    })
}

/// Stops the server gracefully on the first SIGINT or SIGTERM (as the module's documentation
/// says), and the whole process at once on a second.
async fn stop_on_signals(handle: actix_web::dev::ServerHandle) {
    use actix_web::rt::signal::unix::{SignalKind, signal};
    let (Ok(mut interrupt), Ok(mut terminate)) = (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) else {
        eprintln!("warning: the signal handlers could not be installed; stop the server with SIGKILL");
        return;
    };
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    eprintln!("stopping: requests in flight finish and are recorded (a second Ctrl-C stops at once)");
    actix_web::rt::spawn(handle.stop(true));
    tokio::select! {
        _ = interrupt.recv() => {}
        _ = terminate.recv() => {}
    }
    eprintln!("stopping at once: requests in flight are cut");
    std::process::exit(130);
}
