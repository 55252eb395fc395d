use std::path::PathBuf;

use loraplex_adapters::{AdapterLimits, BaseShape};
use loraplex_kernels::cpu::CpuBackend;
use loraplex_kernels::{KvLayout, Memory, RowDType};

use super::*;
use crate::memory::{LoaderConfig, PagePool};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/reference/llama/adapters").join(name)
}

/// The reference llama fixture's shape: 4 layers, hidden 128, 8 heads, 2 KV heads of 16.
fn shape() -> BaseShape {
    BaseShape::llama(128, 344, 8, 2, 16, 4)
}

fn layout() -> KvLayout {
    KvLayout { num_layers: 4, num_kv_heads: 2, head_dim: 16, block_size: 16, dtype: RowDType::F32 }
}

fn setup(pages: usize, host_cache_bytes: u64) -> (CpuBackend, DevicePool<CpuBackend>, AdapterResidency) {
    setup_shared(pages, host_cache_bytes, 100)
}

/// As [`setup`], each tenant's adapters held to `tenant_percent` of the host tier.
fn setup_shared(pages: usize, host_cache_bytes: u64, tenant_percent: u32) -> (CpuBackend, DevicePool<CpuBackend>, AdapterResidency) {
    let backend = CpuBackend::new();
    let layout = layout();
    let buffer = backend.zeros(pages * layout.page_elems()).unwrap();
    let mem = DevicePool { buffer, layout, pages: PagePool::new(pages) };
    let config = LoaderConfig { host_cache_bytes, threads: 2, limits: AdapterLimits::default(), tenant_percent };
    let loader = AdapterLoader::new(&config, shape(), layout.page_elems()).unwrap();
    (backend, mem, AdapterResidency::new(loader, 4, pages))
}

fn reference(name: &str) -> AdapterRef {
    AdapterRef::new(name, fixture(name))
}

/// Polls until `key` leaves the loading and staged states (or a few seconds pass).
fn settle(backend: &CpuBackend, mem: &mut DevicePool<CpuBackend>, res: &mut AdapterResidency, key: &str) -> Residency {
    for _ in 0..500 {
        res.poll_wait(backend, mem, Duration::from_millis(10)).unwrap();
        match res.status(key) {
            Residency::Loading | Residency::Staged => continue,
            other => return other,
        }
    }
    res.status(key)
}

#[test]
fn an_adapter_travels_from_disk_to_pool_pages() {
    let (backend, mut mem, mut res) = setup(64, 1 << 30);
    let a = reference("a2_r16_all");
    assert_eq!(res.request(&a), Residency::Loading);
    assert_eq!(settle(&backend, &mut mem, &mut res, "a2_r16_all"), Residency::Resident);
    let events = res.take_events();
    assert!(matches!(&events[..], [ResidencyEvent::Resident { from: Tier::Disk, .. }]), "{events:?}");
    let (pin, resident) = res.pin("a2_r16_all").unwrap();
    // Every row in the pool holds what the adapter file says (B with the scaling folded in).
    let adapter = loraplex_adapters::LoraAdapter::load(&fixture("a2_r16_all"), &shape(), &AdapterLimits::default()).unwrap();
    let pool = backend.download_f32(&mem.buffer).unwrap();
    let rows = &resident.rows;
    assert_eq!(rows.max_rank, 16);
    for m in adapter.modules() {
        let i = (m.layer * NUM_MODULES + m.module.index()) * 2;
        let (first, rank) = (rows.directory[i] as usize, rows.directory[i + 1] as usize);
        assert_eq!(rank, m.rank);
        for r in 0..rank {
            let a_off = rows.a_rows[first + r] as usize * LORA_ROW_ALIGN;
            assert_eq!(&pool[a_off..a_off + m.in_features], &m.a[r * m.in_features..(r + 1) * m.in_features]);
            let b_off = rows.b_rows[first + r] as usize * LORA_ROW_ALIGN;
            for o in 0..m.out_features {
                assert_eq!(pool[b_off + o], m.b[o * m.rank + r] * m.scaling);
            }
        }
    }
    let stats = mem.pages.stats();
    assert_eq!(stats.adapter, resident.num_pages());
    assert_eq!(stats.reclaimable, 0, "pinned by the test");
    drop(pin);
    assert_eq!(mem.pages.stats().reclaimable, resident.num_pages());
}

#[test]
fn an_evicted_adapter_comes_back_from_host_memory() {
    let (backend, mut mem, mut res) = setup(24, 1 << 30);
    let a = reference("a1_r8_qv");
    res.request(&a);
    assert_eq!(settle(&backend, &mut mem, &mut res, "a1_r8_qv"), Residency::Resident);
    res.take_events();
    let pages = res.pin("a1_r8_qv").unwrap().1.num_pages();
    // KV demand takes every page: the idle adapter is evicted.
    assert_eq!(res.locate("a1_r8_qv"), AdapterLocation { location: Location::Pool, pinned_by: vec![] });
    let kv = mem.pages.lease(24).expect("the unpinned adapter's pages are reclaimable");
    assert_eq!(res.status("a1_r8_qv"), Residency::Absent);
    assert!(res.pin("a1_r8_qv").is_none());
    assert_eq!(res.locate("a1_r8_qv").location, Location::Host, "evicted from the pool, cached in host memory");
    assert_eq!(res.locate("never_requested").location, Location::Disk);
    drop(kv);
    assert_eq!(res.request(&a), Residency::Staged, "still in host memory");
    assert_eq!(settle(&backend, &mut mem, &mut res, "a1_r8_qv"), Residency::Resident);
    let events = res.take_events();
    assert!(matches!(&events[..], [ResidencyEvent::Resident { from: Tier::Host, .. }]), "{events:?}");
    assert_eq!(mem.pages.stats().adapter, pages);
}

#[test]
fn pinned_and_held_adapters_are_not_evicted() {
    let (backend, mut mem, mut res) = setup(24, 1 << 30);
    for name in ["a1_r8_qv", "a3_r4_rslora"] {
        res.request(&reference(name));
        assert_eq!(settle(&backend, &mut mem, &mut res, name), Residency::Resident);
    }
    let pin = res.pin("a1_r8_qv").unwrap();
    let operator = Holder { id: "".into(), max_pages: usize::MAX };
    assert_eq!(res.hold("a3_r4_rslora", &operator), Ok(true));
    let used = mem.pages.stats().adapter;
    assert!(mem.pages.lease(24 - used + 1).is_none(), "no pinned page may be taken");
    assert!(res.status("a1_r8_qv") == Residency::Resident && res.status("a3_r4_rslora") == Residency::Resident);
    drop(pin);
    assert!(!res.release("a3_r4_rslora", "someone else"), "only its holder lets a pin go");
    assert!(res.release("a3_r4_rslora", ""));
    assert!(mem.pages.lease(24).is_some(), "both are reclaimable once let go");
}

#[test]
fn pins_belong_to_their_holders_and_are_capped_per_holder_and_for_the_pool() {
    let (backend, mut mem, mut res) = setup(64, 1 << 30);
    res.max_held_pages = 0;
    for name in ["a1_r8_qv", "a3_r4_rslora"] {
        res.request(&reference(name));
        assert_eq!(settle(&backend, &mut mem, &mut res, name), Residency::Resident);
    }
    let pages = |res: &AdapterResidency, key: &str| res.pin(key).unwrap().1.num_pages();
    let (p1, p3) = (pages(&res, "a1_r8_qv"), pages(&res, "a3_r4_rslora"));
    let tenant = |id: &str, max_pages| Holder { id: id.into(), max_pages };
    // With no share of the pool for pins, nothing can be held.
    assert_eq!(res.hold("a1_r8_qv", &tenant("t1", 100)), Err(HoldError::PoolShare { pages: p1, used: 0, max: 0 }));
    res.max_held_pages = p1 + p3;
    assert_eq!(res.hold("a1_r8_qv", &tenant("t1", p1)), Ok(true));
    assert_eq!(res.hold("a1_r8_qv", &tenant("t1", p1)), Ok(true), "holding twice is one hold");
    // The holder's own cap counts every adapter it holds.
    assert_eq!(res.hold("a3_r4_rslora", &tenant("t1", p1)), Err(HoldError::HolderCap { pages: p3, used: p1, max: p1 }));
    // Another holder of the same adapter is charged for it too, but the pool only once.
    assert_eq!(res.hold("a1_r8_qv", &tenant("t2", p1)), Ok(true));
    assert_eq!(res.held_pages(), p1);
    assert_eq!(res.hold("a3_r4_rslora", &tenant("op", usize::MAX)), Ok(true));
    assert_eq!(res.held_pages(), p1 + p3);
    assert_eq!(res.locate("a1_r8_qv").pinned_by, vec![Arc::<str>::from("t1"), "t2".into()]);
    let json = serde_json::to_value(res.locate("a3_r4_rslora")).unwrap();
    assert_eq!(json, serde_json::json!({"tier": "pool", "pinned_by": ["op"]}));
    // t2 letting go leaves t1's pin in place; t1's release drops the last one.
    assert!(res.release("a1_r8_qv", "t2"));
    assert!(!res.release("a1_r8_qv", "t2"));
    assert_eq!(res.held_pages_of("t1"), p1);
    assert!(res.release("a1_r8_qv", "t1"));
    assert_eq!(res.held_pages(), p3);
    // Not resident: nothing to hold yet.
    assert_eq!(res.hold("a2_r16_all", &tenant("t1", 1000)), Ok(false));
}

#[test]
fn a_staged_adapter_waits_for_room_instead_of_taking_pinned_pages() {
    let (backend, mut mem, mut res) = setup(64, 1 << 30);
    let kv = mem.pages.lease(60).unwrap();
    res.request(&reference("a2_r16_all"));
    for _ in 0..300 {
        res.poll_wait(&backend, &mut mem, Duration::from_millis(10)).unwrap();
        if res.status("a2_r16_all") == Residency::Staged {
            break;
        }
    }
    assert_eq!(res.status("a2_r16_all"), Residency::Staged);
    res.poll(&backend, &mut mem).unwrap();
    assert_eq!(res.status("a2_r16_all"), Residency::Staged, "no room: it waits");
    drop(kv);
    assert_eq!(settle(&backend, &mut mem, &mut res, "a2_r16_all"), Residency::Resident);
}

#[test]
fn a_bad_adapter_fails_without_leaving_anything_behind() {
    let (backend, mut mem, mut res) = setup(24, 1 << 30);
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("a1_r8_qv");
    std::fs::copy(src.join("adapter_config.json"), dir.path().join("adapter_config.json")).unwrap();
    let weights = std::fs::read(src.join("adapter_model.safetensors")).unwrap();
    std::fs::write(dir.path().join("adapter_model.safetensors"), &weights[..weights.len() / 2]).unwrap();
    let bad = AdapterRef::new("truncated", dir.path());
    res.request(&bad);
    let status = settle(&backend, &mut mem, &mut res, "truncated");
    let Residency::Failed(msg) = status else { panic!("{status:?}") };
    assert!(msg.contains("adapter_model.safetensors"), "{msg}");
    assert_eq!(res.locate("truncated").location, Location::Failed(msg));
    assert!(matches!(&res.take_events()[..], [ResidencyEvent::Failed { .. }]));
    assert_eq!(mem.pages.stats().adapter, 0);
    assert!(res.loader().cached("truncated").is_none());
}

#[test]
fn forgetting_keeps_pages_for_running_requests_only() {
    let (backend, mut mem, mut res) = setup(24, 1 << 30);
    res.request(&reference("a1_r8_qv"));
    settle(&backend, &mut mem, &mut res, "a1_r8_qv");
    let running = res.pin("a1_r8_qv").unwrap();
    res.forget("a1_r8_qv");
    assert_eq!(res.status("a1_r8_qv"), Residency::Absent);
    assert!(mem.pages.stats().adapter > 0, "a running request still reads it");
    drop(running);
    assert_eq!(mem.pages.stats().adapter, 0);
    assert_eq!(mem.pages.stats().free, 24);
}

#[test]
fn the_host_tier_is_bounded_by_bytes() {
    // Room for about one packed adapter: loading a second pushes the first out of host memory.
    let (backend, mut mem, mut res) = setup(64, 200 * 1024);
    for name in ["a2_r16_all", "a1_r8_qv", "a3_r4_rslora"] {
        res.request(&reference(name));
        settle(&backend, &mut mem, &mut res, name);
    }
    assert!(res.loader().host_bytes() <= 200 * 1024, "{}", res.loader().host_bytes());
}

#[test]
fn a_tenant_beyond_its_share_of_the_host_tier_loses_its_own_oldest_adapters() {
    let (backend, mut mem, mut res) = setup(64, 1 << 30);
    res.request(&reference("a2_r16_all"));
    settle(&backend, &mut mem, &mut res, "a2_r16_all");
    let size = res.loader().cached("a2_r16_all").unwrap().packed.bytes() as u64;
    for percent in [100, 15] {
        // Room for eight; a tenant's share (15%) for one.
        let (backend, mut mem, mut res) = setup_shared(64, 8 * size, percent);
        let load = |res: &mut AdapterResidency, mem: &mut DevicePool<CpuBackend>, key: &str, owner: &str| {
            res.request(&AdapterRef::new(key, fixture("a2_r16_all")).for_owner(owner));
            settle(&backend, mem, res, key);
        };
        load(&mut res, &mut mem, "quiet/1", "quiet");
        load(&mut res, &mut mem, "flood/1", "flood");
        load(&mut res, &mut mem, "flood/2", "flood");
        // The operator's adapters take no tenant's share.
        load(&mut res, &mut mem, "operator/1", "");
        let cached = |key: &str| res.loader().cached(key).is_some();
        assert!(cached("quiet/1") && cached("flood/2") && cached("operator/1"), "at {percent}%");
        assert_eq!(cached("flood/1"), percent == 100, "at {percent}%: the flooding tenant's older adapter");
    }
}

/// Polls until `key` is no longer loading from disk (or a few seconds pass).
fn past_loading(backend: &CpuBackend, mem: &mut DevicePool<CpuBackend>, res: &mut AdapterResidency, key: &str) {
    for _ in 0..500 {
        res.poll_wait(backend, mem, Duration::from_millis(10)).unwrap();
        if res.status(key) != Residency::Loading {
            return;
        }
    }
}

/// On a device whose uploads take a while (the backend stands in for a copy queue), an adapter
/// with pages is `copying` until a poll sees its copy landed: not pinnable, not counted as
/// resident, its pages kept from eviction; then resident with one event. Forgetting one mid-copy
/// frees its pages.
#[test]
fn an_adapter_is_used_only_once_its_copy_has_landed() {
    let (_, mut mem, mut res) = setup(64, 1 << 30);
    let backend = CpuBackend::new().with_upload_polls(2);
    let a = reference("a2_r16_all");
    res.request(&a);
    past_loading(&backend, &mut mem, &mut res, "a2_r16_all");
    // The load finished and placement started in that poll; the copy's first check said "in flight".
    assert_eq!(res.status("a2_r16_all"), Residency::Copying);
    assert!(res.is_copying());
    assert!(res.pin("a2_r16_all").is_none(), "not usable before the copy lands");
    assert!(res.resident_keys().is_empty());
    assert_eq!(res.locate("a2_r16_all").location, Location::Host);
    assert!(res.take_events().is_empty());
    let pages = mem.pages.stats().adapter;
    assert!(pages > 0);
    assert!(mem.pages.lease(64).is_none(), "the copy's pages are not reclaimable");
    res.poll(&backend, &mut mem).unwrap();
    assert_eq!(res.status("a2_r16_all"), Residency::Copying, "second check: still in flight");
    res.poll(&backend, &mut mem).unwrap();
    assert_eq!(res.status("a2_r16_all"), Residency::Resident);
    assert!(!res.is_copying());
    let events = res.take_events();
    assert!(matches!(&events[..], [ResidencyEvent::Resident { from: Tier::Disk, .. }]), "{events:?}");
    assert!(res.pin("a2_r16_all").is_some());
    assert_eq!(mem.pages.stats().reclaimable, pages, "idle once resident");

    let b = reference("a1_r8_qv");
    res.request(&b);
    past_loading(&backend, &mut mem, &mut res, "a1_r8_qv");
    assert_eq!(res.status("a1_r8_qv"), Residency::Copying);
    let before = mem.pages.stats().adapter;
    res.forget("a1_r8_qv");
    assert_eq!(res.status("a1_r8_qv"), Residency::Absent);
    assert!(mem.pages.stats().adapter < before, "a forgotten copy gives its pages back");
}
