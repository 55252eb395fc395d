//! What replicas sharing one database learn from each other.
//!
//! Every request reads the adapter it names from the database, so a new version or a deletion
//! made through any replica is what the next request on every replica sees. What each replica
//! holds on its own is the rest: an adapter version resident in its pool or host memory, and its
//! copy of the files. [`watch`] polls the database for versions deleted elsewhere and lets them go
//! here as the deleting replica does: unloaded (pins released), new requests refused, files
//! removed once the requests running on them have finished. It also stops the batches this
//! replica runs that a tenant cancelled through another replica, and, where replicas mark
//! themselves alive (the shared limits, on PostgreSQL), takes over the batches of a replica that
//! has not been seen for [`ADOPT_AFTER_MS`].

use std::collections::HashMap;
use std::time::Duration;

use super::AppState;

/// Deletions are looked for this far back: a row whose commit came late, or written by a
/// replica whose clock runs behind, is still seen.
const SLACK_MS: i64 = 120_000;

/// A replica not seen for this long (it marks itself alive every few seconds) has its batches
/// taken over.
pub const ADOPT_AFTER_MS: i64 = 30_000;

/// How often batches to take over are looked for.
const ADOPT_EVERY: Duration = Duration::from_secs(5);

/// Cancellations from other replicas, batches to take over, and batches another replica took
/// over from this one (cut off from the database for long enough to be thought gone): those
/// stop here, starting no more lines, and leave their end to their new runner.
pub(crate) async fn batches(state: &AppState, adopt: bool) -> Result<(), crate::store::StoreError> {
    let me = &state.settings.instance;
    for id in state.store.batches_cancelling(me).await? {
        if !state.batches.signal(&id, super::batch::Stop::Cancel) {
            // No task here (it ended, or never ran here): one writes what finished.
            super::batch::Batches::start(state, &id);
        }
    }
    if adopt {
        let here = state.batches.running_ids();
        if !here.is_empty() {
            for id in state.store.batches_run_elsewhere(&here, me).await? {
                eprintln!("warning: batch {id} is run by another replica now (this one was thought gone); it stops here");
                state.batches.signal(&id, super::batch::Stop::Shutdown);
            }
        }
        for id in state.store.adopt_batches(me, crate::store::now_ms() - ADOPT_AFTER_MS).await? {
            println!("batches: took over {id} from a replica no longer seen");
            super::batch::Batches::start(state, &id);
        }
    }
    Ok(())
}

/// Polls for adapter versions deleted through other replicas (and for batches, see the module
/// docs) every `every`, for as long as the server runs. Runs on the main thread (it talks to the
/// runtime).
pub fn watch(state: AppState, every: Duration) {
    super::on_main_thread(move || async move {
        let mut seen: HashMap<String, i64> = HashMap::new();
        let mut failing = false;
        let mut adopted_at = std::time::Instant::now();
        loop {
            actix_web::rt::time::sleep(every).await;
            let adopt = state.limiter.is_shared() && adopted_at.elapsed() >= ADOPT_EVERY;
            if adopt {
                adopted_at = std::time::Instant::now();
            }
            if let Err(e) = batches(&state, adopt).await
                && !failing
            {
                eprintln!("warning: looking for batches cancelled or left by other replicas: {e} (retrying)");
            }
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
