//! What replicas sharing one database learn from each other.
//!
//! Every request reads the adapter it names from the database, so a new version or a deletion
//! made through any replica is what the next request on every replica sees. What each replica
//! holds on its own is the rest: an adapter version resident in its pool or host memory, and its
//! copy of the files. [`watch`] polls the database for versions deleted elsewhere and lets them go
//! here as the deleting replica does: unloaded (pins released), new requests refused, files
//! removed once the requests running on them have finished.

use std::collections::HashMap;
use std::time::Duration;

use super::AppState;

/// Deletions are looked for this far back: a row whose commit came late, or written by a
/// replica whose clock runs behind, is still seen.
const SLACK_MS: i64 = 120_000;

/// Polls for adapter versions deleted through other replicas every `every`, for as long as the
/// server runs. Runs on the main thread (it talks to the runtime).
pub fn watch(state: AppState, every: Duration) {
    super::on_main_thread(move || async move {
        let mut seen: HashMap<String, i64> = HashMap::new();
        let mut failing = false;
        loop {
            actix_web::rt::time::sleep(every).await;
            let since = crate::store::now_ms().saturating_sub(SLACK_MS);
            match state.store.adapters_deleted_since(since).await {
                Ok(rows) => {
                    failing = false;
                    let mut gone = Vec::new();
                    for (record, at) in rows {
                        if seen.insert(record.id.clone(), at).is_some() {
                            continue;
                        }
                        state.serving.unload_adapter(record.id.as_str().into(), record.owner.as_str().into(), true).await;
                        gone.extend(super::adapters::retire(&state, &record));
                    }
                    if !gone.is_empty() {
                        let _ = state.background.run(move || gone.iter().for_each(|d| super::adapters::remove_dir(d))).await;
                    }
                    seen.retain(|_, at| *at >= since);
                }
                Err(e) if !failing => {
                    failing = true;
                    eprintln!("warning: looking for adapters deleted elsewhere: {e} (retrying)");
                }
                Err(_) => {}
            }
        }
    });
}
