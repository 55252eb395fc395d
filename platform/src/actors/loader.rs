//! The adapter loader: reads, validates and packs adapters from disk into the host tier, on
//! threads of its own (a `SyncArbiter`), so that no worker or async executor waits on a disk.

use actix::{Actor, Handler, Message, SyncContext};

use crate::memory::LoadTask;

/// Runs one load (see [`crate::memory::LoaderPool`]); its outcome goes to the asker's channel.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RunLoad(pub LoadTask);

/// One of the loader's threads.
pub struct Loader;

impl Actor for Loader {
    type Context = SyncContext<Self>;
}

impl Handler<RunLoad> for Loader {
    type Result = ();

    fn handle(&mut self, RunLoad(task): RunLoad, _ctx: &mut Self::Context) {
        task();
    }
}
