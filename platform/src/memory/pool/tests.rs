use super::*;

fn sorted(mut v: Vec<u32>) -> Vec<u32> {
    v.sort_unstable();
    v
}

#[test]
fn leases_return_pages_on_drop() {
    let pool = PagePool::new(4);
    let a = pool.lease(3).unwrap();
    assert_eq!(a.pages(), &[0, 1, 2]);
    assert!(pool.lease(2).is_none(), "all or nothing");
    assert_eq!((pool.stats().free, pool.stats().kv), (1, 3));
    let mut b = pool.empty_lease();
    assert!(b.grow(1));
    assert!(!b.grow(1));
    drop(a);
    assert_eq!(pool.stats().free, 3);
    assert!(b.grow(3));
    assert_eq!(sorted(b.pages().to_vec()), vec![0, 1, 2, 3], "no page handed out twice");
    drop(b);
    assert_eq!(pool.stats(), PoolStats { total: 4, free: 4, ..Default::default() });
}

#[test]
fn pinned_entries_are_never_evicted() {
    let pool = PagePool::new(6);
    let (a, pin_a) = pool.insert(EntryKind::Adapter, 3).unwrap();
    let (b, pin_b) = pool.insert(EntryKind::Adapter, 2).unwrap();
    assert_eq!(pool.stats().reclaimable, 0);
    assert!(pool.lease(2).is_none(), "only one page is free and nothing is unpinned");
    assert!(pool.insert(EntryKind::Adapter, 2).is_none());
    assert!(a.is_resident() && b.is_resident());
    drop(pin_b);
    assert_eq!(pool.stats().reclaimable, 2);
    let lease = pool.lease(3).expect("b's pages can be reclaimed");
    assert!(!b.is_resident(), "b was unpinned, so it went");
    assert!(b.pin().is_none(), "an evicted entry cannot be pinned");
    assert!(a.is_resident(), "a stayed pinned");
    assert_eq!(pool.stats().evictions, 1);
    drop((lease, pin_a));
}

#[test]
fn eviction_takes_the_least_recently_used_unpinned_entries() {
    let pool = PagePool::new(6);
    let (a, pa) = pool.insert(EntryKind::Adapter, 2).unwrap();
    let (b, pb) = pool.insert(EntryKind::Adapter, 2).unwrap();
    let (c, pc) = pool.insert(EntryKind::Prefix, 2).unwrap();
    // Last used order: b, a, c.
    drop(pb);
    drop(pa);
    drop(pc);
    // Using b again makes it the most recent.
    drop(b.pin().unwrap());
    // Order now: a, c, b.
    let l1 = pool.lease(2).unwrap();
    assert!(!a.is_resident() && c.is_resident() && b.is_resident());
    let l2 = pool.lease(2).unwrap();
    assert!(!c.is_resident() && b.is_resident());
    assert_eq!(pool.stats().evictions, 2);
    assert_eq!(pool.stats().cached, 0);
    drop((l1, l2));
}

#[test]
fn dropping_the_owner_frees_pages_after_the_last_pin() {
    let pool = PagePool::new(4);
    let (a, pin) = pool.insert(EntryKind::Adapter, 3).unwrap();
    let pages = a.pages();
    let pin2 = pin.clone();
    drop(a);
    assert_eq!(pool.stats().free, 1, "still pinned by requests in flight");
    drop(pin);
    assert_eq!(pool.stats().free, 1);
    drop(pin2);
    assert_eq!(pool.stats(), PoolStats { total: 4, free: 4, ..Default::default() });
    assert_eq!(sorted(pool.lease(4).unwrap().pages().to_vec()), sorted([pages, vec![3]].concat()));
}

#[test]
fn stats_count_each_kind() {
    let pool = PagePool::new(10);
    let kv = pool.lease(3).unwrap();
    let (_a, pa) = pool.insert(EntryKind::Adapter, 2).unwrap();
    let (_p, pp) = pool.insert(EntryKind::Prefix, 1).unwrap();
    drop(pp);
    let s = pool.stats();
    assert_eq!((s.total, s.free, s.kv, s.adapter, s.cached, s.reclaimable), (10, 4, 3, 2, 1, 1));
    assert_eq!(pool.available(), 5);
    drop((kv, pa));
    assert_eq!(pool.stats().reclaimable, 3);
}

/// Random operations keep every page in exactly one place, and pinned entries resident.
#[test]
fn random_operations_keep_the_invariants() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let pool = PagePool::new(64);
    pool.set_tenant_share(Some(10));
    let mut leases: Vec<PageLease> = Vec::new();
    let mut entries: Vec<(CachedPages, Vec<PagePin>)> = Vec::new();
    for _ in 0..4000 {
        match rng.random_range(0..8) {
            0 => {
                if let Some(l) = pool.lease(rng.random_range(0..6)) {
                    leases.push(l);
                }
            }
            1 if !leases.is_empty() => {
                let i = rng.random_range(0..leases.len());
                leases.swap_remove(i);
            }
            2 => {
                let kind = if rng.random_bool(0.5) { EntryKind::Adapter } else { EntryKind::Prefix };
                if let Some((e, pin)) = pool.insert(kind, rng.random_range(1..8)) {
                    entries.push((e, vec![pin]));
                }
            }
            3 if !entries.is_empty() => {
                let i = rng.random_range(0..entries.len());
                entries[i].1.pop();
            }
            4 if !entries.is_empty() => {
                let i = rng.random_range(0..entries.len());
                if let Some(p) = entries[i].0.pin() {
                    entries[i].1.push(p);
                }
            }
            6 => {
                // A prefix block of one of three tenants, whose share is a tenth of the pool.
                if let Some(mut l) = pool.lease(1) {
                    let page = l.pages()[0];
                    let tenant: Arc<str> = ["a", "b", "c"][rng.random_range(0..3)].into();
                    if let Some((e, pin)) = l.into_entry(page, EntryKind::Prefix, Some(tenant)) {
                        entries.push((e, vec![pin]));
                    }
                }
            }
            5 if !entries.is_empty() => {
                // The owner goes; its pins stay with the requests using it.
                let i = rng.random_range(0..entries.len());
                let (owner, pins) = entries.swap_remove(i);
                drop(owner);
                drop(pins);
            }
            _ => {}
        }
        let s = pool.stats();
        let mut seen: Vec<u32> = leases.iter().flat_map(|l| l.pages().to_vec()).collect();
        for (e, pins) in &entries {
            if !pins.is_empty() {
                assert!(e.is_resident(), "a pinned entry was evicted");
            }
            seen.extend(e.pages());
        }
        assert_eq!(s.kv, leases.iter().map(PageLease::len).sum::<usize>());
        assert_eq!(s.free + seen.len(), s.total, "{s:?}");
        let n = seen.len();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), n, "a page is in two places");
        assert!(s.reclaimable <= s.adapter + s.cached);
        assert!(["a", "b", "c"].iter().map(|t| pool.tenant_cached(t)).sum::<usize>() <= s.reclaimable);
    }
}

#[test]
fn a_leased_page_becomes_a_shared_entry() {
    let pool = PagePool::new(4);
    let mut lease = pool.lease(2).unwrap();
    let page = lease.pages()[1];
    assert!(lease.into_entry(99, EntryKind::Prefix, None).is_none(), "not this lease's page");
    let (entry, pin) = lease.into_entry(page, EntryKind::Prefix, None).unwrap();
    assert_eq!(lease.pages().len(), 1);
    assert_eq!(entry.pages(), vec![page]);
    assert_eq!((pool.stats().kv, pool.stats().cached, pool.stats().reclaimable), (1, 1, 0));
    let second = pin.clone();
    drop(pin);
    drop(lease);
    assert_eq!(pool.stats().reclaimable, 0, "still pinned by a second sharer");
    drop(second);
    assert_eq!((pool.stats().free, pool.stats().reclaimable, pool.stats().cached), (3, 1, 1), "cached, evictable");
    let all = pool.lease(4).expect("the cached block is reclaimed under pressure");
    assert!(!entry.is_resident());
    drop(all);
    drop(entry);
    assert_eq!(pool.stats(), PoolStats { total: 4, free: 4, evictions: 1, ..Default::default() });
}

/// `n` cached blocks of `tenant`, unpinned (evictable), oldest first.
fn cached_blocks(pool: &PagePool, tenant: &str, n: usize) -> Vec<CachedPages> {
    let mut lease = pool.lease(n).unwrap();
    let tenant: Arc<str> = tenant.into();
    let pages = lease.pages().to_vec();
    pages.into_iter().map(|p| lease.into_entry(p, EntryKind::Prefix, Some(tenant.clone())).unwrap().0).collect()
}

#[test]
fn a_tenant_beyond_its_share_evicts_its_own_blocks_first() {
    for share in [None, Some(30)] {
        let pool = PagePool::new(10);
        pool.set_tenant_share(share);
        let quiet = cached_blocks(&pool, "quiet", 2);
        let flood = cached_blocks(&pool, "flood", 6);
        assert_eq!((pool.tenant_cached("quiet"), pool.tenant_cached("flood")), (2, 6));
        assert_eq!(pool.stats().reclaimable, 8);
        // Two pages free; four more must come from the cache.
        let _lease = pool.lease(6).unwrap();
        let kept = |blocks: &[CachedPages]| blocks.iter().filter(|b| b.is_resident()).count();
        match share {
            // One LRU: the oldest go, which are the quiet tenant's.
            None => assert_eq!((kept(&quiet), kept(&flood)), (0, 4)),
            // The flooding tenant holds 6 against a share of 3: its own oldest three go, then
            // the oldest of all (a quiet block).
            Some(_) => {
                assert_eq!((kept(&quiet), kept(&flood)), (1, 3));
                assert!(!flood[2].is_resident() && flood[3].is_resident(), "its oldest first");
                assert!(!quiet[0].is_resident() && quiet[1].is_resident());
            }
        }
        assert_eq!(pool.tenant_cached("flood"), kept(&flood));
        // A pin takes a block out of its tenant's count; the last unpin puts it back.
        let pin = flood[5].pin().unwrap();
        assert_eq!(pool.tenant_cached("flood"), kept(&flood) - 1);
        drop(pin);
        assert_eq!(pool.tenant_cached("flood"), kept(&flood));
        drop((quiet, flood));
        assert_eq!((pool.tenant_cached("quiet"), pool.tenant_cached("flood"), pool.stats().reclaimable), (0, 0, 0));
    }
}
