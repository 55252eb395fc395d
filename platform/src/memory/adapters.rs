//! Adapter residency: moving adapters from disk through host memory into pool pages, and knowing
//! where each one is.
//!
//! An adapter's path through the tiers:
//! `request` -> loading (disk -> host, on the loader threads) -> staged (in host memory, waiting
//! for pages) -> copying (pages taken, the page images on the device's copy queue) -> resident
//! (the copy landed; its row table built). A
//! resident adapter is an unpinned cache entry of the pool: requests pin it while they run, and
//! the pool may evict it when nothing does. A request for an evicted adapter starts again from
//! host memory when it is still cached there, else from disk.
//!
//! Nothing here blocks: [`AdapterResidency::poll`] takes finished loads and places staged
//! adapters whose pages can be found now; the rest waits for a later poll. On CUDA the page
//! images go through page-locked staging memory on a second stream while steps compute, and a
//! later poll sees the copy landed; on the CPU backend the copy is done between steps (about a
//! millisecond per 10 MB) and has landed at once. Reading, validating and packing happen on the
//! loader threads.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use loraplex_adapters::{PackedAdapter, RowStorage};
use loraplex_kernels::{Backend, KernelError, LORA_ROW_ALIGN, NUM_MODULES, RowDType, Upload};

use super::host::{AdapterLoader, HostAdapter};
use super::{CachedPages, DevicePool, EntryKind, PagePin};

/// What a request names: the adapter's identity (unique per content version, e.g.
/// `tenant/name@version`, or a directory path) and where its files are.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AdapterRef {
    pub key: Arc<str>,
    pub dir: Arc<Path>,
    /// The directory was validated when the adapter was uploaded and holds its manifest
    /// (`loraplex_adapter.json`): loads read that, not the PEFT config.
    pub validated: bool,
    /// The tenant whose adapter it is, for its share of the host tier (`None`: no share).
    pub tenant: Option<Arc<str>>,
}

impl AdapterRef {
    /// A PEFT adapter directory, parsed and validated when it is loaded.
    pub fn new(key: impl Into<Arc<str>>, dir: impl AsRef<Path>) -> Self {
        Self { key: key.into(), dir: Arc::from(dir.as_ref()), validated: false, tenant: None }
    }

    /// The same, as the adapter of `owner` (a tenant's id; empty for the operator's adapters,
    /// which take no tenant's share).
    pub fn for_owner(self, owner: &str) -> Self {
        Self { tenant: (!owner.is_empty()).then(|| owner.into()), ..self }
    }

    /// An uploaded adapter, validated once at upload (see [`loraplex_adapters::Manifest`]).
    pub fn validated(key: impl Into<Arc<str>>, dir: impl AsRef<Path>) -> Self {
        Self { validated: true, ..Self::new(key, dir) }
    }
}

/// Where an adapter came from when it became resident.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Disk,
    Host,
}

/// Where an adapter is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Residency {
    /// Never requested (or forgotten).
    Absent,
    /// Being read from disk.
    Loading,
    /// In host memory, waiting for pool pages.
    Staged,
    /// Given pool pages, its rows on their way there (the device's copy queue); usable once
    /// the copy lands.
    Copying,
    /// In pool pages, usable by a batch.
    Resident,
    /// Refused; the message names the file and tensor or key at fault.
    Failed(Arc<str>),
}

/// Where an adapter's rows are on one device, as an operator sees it: the fastest tier that
/// holds them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase", tag = "tier", content = "error")]
pub enum Location {
    /// In pool pages: a request uses it without a load.
    Pool,
    /// In host memory (cached after an eviction, or waiting for pool pages).
    Host,
    /// Being read from disk.
    Loading,
    /// Only on disk.
    Disk,
    /// Its last load was refused; the message says why.
    Failed(Arc<str>),
}

/// An adapter's [`Location`] on one device and who keeps it pinned there.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AdapterLocation {
    #[serde(flatten)]
    pub location: Location,
    /// The holders of its pins (tenant ids; empty for the operator), sorted.
    pub pinned_by: Vec<Arc<str>>,
}

/// A change worth telling callers about.
#[derive(Debug, Clone, PartialEq)]
pub enum ResidencyEvent {
    Resident { key: Arc<str>, from: Tier, waited: Duration },
    Failed { key: Arc<str>, error: Arc<str> },
}

/// Where an adapter's rows are in the pool, in the form the LoRA kernels read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidentRows {
    /// `[num_layers * NUM_MODULES * 2]`: per (layer, module), the first index into `a_rows` and
    /// `b_rows` and the rank (0 when not targeted).
    pub directory: Vec<u32>,
    /// Pool offset of every A row, in units of [`LORA_ROW_ALIGN`] values.
    pub a_rows: Vec<u32>,
    /// Pool offset of every B row (Bᵀ rows with the scaling folded in).
    pub b_rows: Vec<u32>,
    pub max_rank: usize,
    /// How the rows are stored.
    pub dtype: RowDType,
}

impl ResidentRows {
    /// The row table of `packed` once its page images `i` sit in pool pages `pages[i]`.
    pub fn place(packed: &PackedAdapter, pages: &[u32], num_layers: usize) -> Result<Self, String> {
        if pages.len() != packed.num_pages() {
            return Err(format!("{} pages given for an adapter of {}", pages.len(), packed.num_pages()));
        }
        let pe = packed.page_elems();
        let mut directory = vec![0u32; num_layers * NUM_MODULES * 2];
        for e in packed.entries() {
            if e.layer >= num_layers {
                return Err(format!("the adapter targets layer {} of a model with {num_layers}", e.layer));
            }
            let i = (e.layer * NUM_MODULES + e.module.index()) * 2;
            directory[i] = e.first_row as u32;
            directory[i + 1] = e.rank as u32;
        }
        let place = |offsets: &[usize]| -> Result<Vec<u32>, String> {
            offsets
                .iter()
                .map(|&o| {
                    let abs = pages[o / pe] as usize * pe + o % pe;
                    u32::try_from(abs / LORA_ROW_ALIGN).map_err(|_| "the pool is too large to address adapter rows".to_string())
                })
                .collect()
        };
        let max_rank = packed.entries().iter().map(|e| e.rank).max().unwrap_or(0);
        let dtype = match packed.storage() {
            RowStorage::F32 => RowDType::F32,
            RowStorage::Bf16 => RowDType::Bf16,
        };
        Ok(ResidentRows { directory, a_rows: place(packed.a_rows())?, b_rows: place(packed.b_rows())?, max_rank, dtype })
    }
}

/// An adapter in pool pages. Its rows stay valid while a [`PagePin`] of it is held.
#[derive(Debug)]
pub struct ResidentAdapter {
    pub key: Arc<str>,
    pub content_hash: String,
    pub rows: ResidentRows,
    pages: CachedPages,
}

impl ResidentAdapter {
    pub fn num_pages(&self) -> usize {
        self.pages.pages().len()
    }
}

/// Who asks for an adapter to stay pinned in the pool (a tenant, or the operator), and how many
/// pages of this pool all of its pins together may take.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Holder {
    /// The tenant's id; empty for the operator.
    pub id: Arc<str>,
    pub max_pages: usize,
}

/// Why a pin was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HoldError {
    /// The holder's own pins would take more pages than its cap.
    #[error("pinning this adapter takes {pages} pool pages; your pins already take {used} of your limit of {max}; unload one first")]
    HolderCap { pages: usize, used: usize, max: usize },
    /// Every holder's pins together would take more than the share of the pool pins may have
    /// (the rest stays for running requests).
    #[error("pinning this adapter takes {pages} pool pages; pins already take {used} of the {max} the server allows; try again later")]
    PoolShare { pages: usize, used: usize, max: usize },
}

/// An adapter kept pinned on behalf of one or more holders.
struct Held {
    /// Keeps the pages; released when dropped.
    _pin: PagePin,
    pages: usize,
    holders: HashSet<Arc<str>>,
}

enum State {
    Loading {
        since: Instant,
    },
    Staged {
        since: Instant,
        from: Tier,
        host: Arc<HostAdapter>,
    },
    /// Its pages taken and its copy started; the pin keeps the pages until the copy lands.
    Copying {
        since: Instant,
        from: Tier,
        upload: Upload,
        resident: Arc<ResidentAdapter>,
        _pin: PagePin,
    },
    Resident(Arc<ResidentAdapter>),
    Failed(Arc<str>),
}

/// The adapters of one device: their states, the host tier, and their pool entries.
pub struct AdapterResidency {
    loader: AdapterLoader,
    num_layers: usize,
    states: HashMap<Arc<str>, State>,
    /// Staged adapters in the order they are to be placed.
    staged: VecDeque<Arc<str>>,
    /// Adapters whose copy into the pool is in flight (each in [`State::Copying`] unless
    /// forgotten since).
    copying: Vec<Arc<str>>,
    /// Pins held on behalf of callers that asked for an adapter to stay resident.
    held: HashMap<Arc<str>, Held>,
    /// Most pages all holds together may pin.
    max_held_pages: usize,
    events: Vec<ResidencyEvent>,
}

impl AdapterResidency {
    /// `max_held_pages` bounds what [`Self::hold`] may pin, so that the rest of the pool stays
    /// for requests.
    pub fn new(loader: AdapterLoader, num_layers: usize, max_held_pages: usize) -> Self {
        Self {
            loader,
            num_layers,
            states: HashMap::new(),
            staged: VecDeque::new(),
            copying: Vec::new(),
            held: HashMap::new(),
            max_held_pages,
            events: Vec::new(),
        }
    }

    /// Where `key` is now. An evicted adapter reads as [`Residency::Absent`] until requested.
    pub fn status(&self, key: &str) -> Residency {
        match self.states.get(key) {
            None => Residency::Absent,
            Some(State::Loading { .. }) => Residency::Loading,
            Some(State::Staged { .. }) => Residency::Staged,
            Some(State::Copying { .. }) => Residency::Copying,
            Some(State::Resident(r)) if r.pages.is_resident() => Residency::Resident,
            Some(State::Resident(_)) => Residency::Absent,
            Some(State::Failed(e)) => Residency::Failed(e.clone()),
        }
    }

    /// Where `key`'s rows are now (the host tier consulted for an adapter that is not placed)
    /// and who pins it.
    pub fn locate(&self, key: &str) -> AdapterLocation {
        let location = match self.status(key) {
            Residency::Resident => Location::Pool,
            Residency::Staged | Residency::Copying => Location::Host,
            Residency::Loading => Location::Loading,
            Residency::Failed(e) => Location::Failed(e),
            Residency::Absent if self.loader.cached(key).is_some() => Location::Host,
            Residency::Absent => Location::Disk,
        };
        let mut pinned_by: Vec<Arc<str>> = self.held.get(key).map(|h| h.holders.iter().cloned().collect()).unwrap_or_default();
        pinned_by.sort();
        AdapterLocation { location, pinned_by }
    }

    /// Asks for `adapter` to become resident (a prefetch): starts a disk load or stages it from
    /// host memory unless it is already on its way. Returns where it is now.
    pub fn request(&mut self, adapter: &AdapterRef) -> Residency {
        let status = self.status(&adapter.key);
        if status != Residency::Absent {
            return status;
        }
        let since = Instant::now();
        match self.loader.cached(&adapter.key) {
            Some(host) => {
                self.states.insert(adapter.key.clone(), State::Staged { since, from: Tier::Host, host });
                self.staged.push_back(adapter.key.clone());
                Residency::Staged
            }
            None => {
                self.states.insert(adapter.key.clone(), State::Loading { since });
                self.loader.submit(adapter.clone());
                Residency::Loading
            }
        }
    }

    /// Pool pages a staged adapter needs; `None` unless it is staged.
    pub fn staged_pages(&self, key: &str) -> Option<usize> {
        match self.states.get(key) {
            Some(State::Staged { host, .. }) => Some(host.packed.num_pages()),
            _ => None,
        }
    }

    /// The adapters resident in the pool now.
    pub fn resident_keys(&self) -> Vec<Arc<str>> {
        self.states
            .iter()
            .filter_map(|(k, s)| match s {
                State::Resident(r) if r.pages.is_resident() => Some(k.clone()),
                _ => None,
            })
            .collect()
    }

    /// Whether an adapter waits in host memory for pool pages.
    pub fn has_staged(&self) -> bool {
        !self.staged.is_empty()
    }

    /// Whether any disk load is in flight.
    pub fn is_loading(&self) -> bool {
        self.states.values().any(|s| matches!(s, State::Loading { .. }))
    }

    /// Whether an adapter's copy into the pool is in flight.
    pub fn is_copying(&self) -> bool {
        !self.copying.is_empty()
    }

    /// Pins a resident adapter for a running sequence.
    pub fn pin(&self, key: &str) -> Option<(PagePin, Arc<ResidentAdapter>)> {
        match self.states.get(key) {
            Some(State::Resident(r)) => r.pages.pin().map(|pin| (pin, r.clone())),
            _ => None,
        }
    }

    /// Keeps a resident adapter in the pool on behalf of `holder` until that holder's
    /// [`Self::release`], whether requests use it or not. `Ok(false)` if it is not resident
    /// (yet). Each holder is charged the adapter's pages against its own cap; the adapter's pages
    /// count once against the pool's share for pins.
    pub fn hold(&mut self, key: &str, holder: &Holder) -> Result<bool, HoldError> {
        if self.held.get(key).is_some_and(|h| h.holders.contains(&holder.id)) {
            return Ok(true);
        }
        let Some((pin, r)) = self.pin(key) else { return Ok(false) };
        let pages = r.num_pages();
        let used = self.held_pages_of(&holder.id);
        if used.saturating_add(pages) > holder.max_pages {
            return Err(HoldError::HolderCap { pages, used, max: holder.max_pages });
        }
        match self.held.get_mut(key) {
            Some(h) => {
                h.holders.insert(holder.id.clone());
            }
            None => {
                let used = self.held_pages();
                if used.saturating_add(pages) > self.max_held_pages {
                    return Err(HoldError::PoolShare { pages, used, max: self.max_held_pages });
                }
                self.held.insert(r.key.clone(), Held { _pin: pin, pages, holders: HashSet::from([holder.id.clone()]) });
            }
        }
        Ok(true)
    }

    /// Pages pinned by holds, each adapter counted once.
    pub fn held_pages(&self) -> usize {
        self.held.values().map(|h| h.pages).sum()
    }

    /// Pages of the adapters `holder` keeps pinned.
    pub fn held_pages_of(&self, holder: &str) -> usize {
        self.held.values().filter(|h| h.holders.contains(holder)).map(|h| h.pages).sum()
    }

    /// Lets `holder`'s pin of an adapter go; the adapter can be evicted again once no other
    /// holder keeps it and no request uses it. False if `holder` did not hold it.
    pub fn release(&mut self, key: &str, holder: &str) -> bool {
        let Some(h) = self.held.get_mut(key) else { return false };
        let released = h.holders.remove(holder);
        if h.holders.is_empty() {
            self.held.remove(key);
        }
        released
    }

    /// Forgets an adapter everywhere (a deleted or replaced adapter), every holder's pin
    /// included. Requests already running keep its pages through their pins until they finish.
    pub fn forget(&mut self, key: &str) {
        self.held.remove(key);
        self.states.remove(key);
        self.staged.retain(|k| &**k != key);
        self.copying.retain(|k| &**k != key);
        self.loader.invalidate(key);
    }

    /// Events since the last call.
    pub fn take_events(&mut self) -> Vec<ResidencyEvent> {
        std::mem::take(&mut self.events)
    }

    /// The host tier.
    pub fn loader(&self) -> &AdapterLoader {
        &self.loader
    }

    /// Takes finished loads and copies, and starts placing staged adapters into free (or
    /// reclaimable) pages. Never waits: what cannot be placed now stays staged, and a copy still
    /// in flight is looked at again by the next poll.
    pub fn poll<B: Backend>(&mut self, backend: &B, mem: &mut DevicePool<B>) -> Result<(), KernelError> {
        for done in self.loader.completed() {
            self.finish_load(done.key, done.result);
        }
        self.place(backend, mem)?;
        self.finish_copies()
    }

    /// Adapters whose copy has landed become resident.
    fn finish_copies(&mut self) -> Result<(), KernelError> {
        let mut landed = Vec::new();
        for key in &self.copying {
            if let Some(State::Copying { upload, .. }) = self.states.get_mut(key)
                && upload.is_landed()?
            {
                landed.push(key.clone());
            }
        }
        self.copying.retain(|k| !landed.contains(k));
        for key in landed {
            let Some(State::Copying { since, from, resident, .. }) = self.states.remove(&key) else { continue };
            // The pin taken at insertion is released: the adapter is now an idle cache entry.
            self.states.insert(key.clone(), State::Resident(resident));
            self.events.push(ResidencyEvent::Resident { key, from, waited: since.elapsed() });
        }
        Ok(())
    }

    /// Like [`Self::poll`], but first waits up to `timeout` for a load to finish when one is in
    /// flight (for callers that have nothing else to do).
    pub fn poll_wait<B: Backend>(&mut self, backend: &B, mem: &mut DevicePool<B>, timeout: Duration) -> Result<(), KernelError> {
        if self.is_loading()
            && let Some(done) = self.loader.wait(timeout)
        {
            self.finish_load(done.key, done.result);
        }
        self.poll(backend, mem)
    }

    fn finish_load(&mut self, key: Arc<str>, result: Result<Arc<HostAdapter>, Arc<str>>) {
        // A load for an adapter forgotten meanwhile is dropped.
        let Some(State::Loading { since }) = self.states.get(&key) else { return };
        let since = *since;
        match result {
            Ok(host) => {
                self.states.insert(key.clone(), State::Staged { since, from: Tier::Disk, host });
                self.staged.push_back(key);
            }
            Err(error) => self.fail(key, error),
        }
    }

    fn fail(&mut self, key: Arc<str>, error: Arc<str>) {
        self.states.insert(key.clone(), State::Failed(error.clone()));
        self.events.push(ResidencyEvent::Failed { key, error });
    }

    fn place<B: Backend>(&mut self, backend: &B, mem: &mut DevicePool<B>) -> Result<(), KernelError> {
        let total = mem.pages.stats().total;
        while let Some(key) = self.staged.front().cloned() {
            let Some(State::Staged { since, from, host }) = self.states.get(&key) else {
                self.staged.pop_front();
                continue;
            };
            let (since, from, host) = (*since, *from, host.clone());
            let n = host.packed.num_pages();
            if n > total {
                self.staged.pop_front();
                let error = format!("adapter {key} needs {n} pool pages but the pool has {total}; raise --pool-mb");
                self.fail(key, error.into());
                continue;
            }
            // Pinned pages are never taken: if they leave too little room, try again later.
            let Some((entry, pin)) = mem.pages.insert(EntryKind::Adapter, n) else { break };
            self.staged.pop_front();
            let pages = entry.pages();
            let rows = match ResidentRows::place(&host.packed, &pages, self.num_layers) {
                Ok(rows) => rows,
                Err(error) => {
                    let error = format!("adapter {key}: {error}");
                    self.fail(key, error.into());
                    continue;
                }
            };
            let pe = mem.page_elems();
            let writes: Vec<(usize, &[f32])> = pages.iter().enumerate().map(|(i, &p)| (p as usize * pe, host.packed.page(i))).collect();
            // On a device with a copy queue the rows travel while steps run; the adapter is used
            // only once they have landed.
            let upload = backend.start_upload(&mut mem.buffer, &writes)?;
            let resident = Arc::new(ResidentAdapter { key: key.clone(), content_hash: host.content_hash.clone(), rows, pages: entry });
            self.states.insert(key.clone(), State::Copying { since, from, upload, resident, _pin: pin });
            self.copying.push(key);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
