-- Tenant limits that hold across replicas sharing one PostgreSQL database. A server on SQLite
-- keeps its windows in memory and never writes these tables.

-- One row per admitted request (or batch line): it counts against the tenant's requests per
-- minute while `at_ms` is within the last minute, against its tokens per minute with `tokens`
-- (reserved, then what it used), and against its concurrency while `running` is 1 and its
-- replica is alive.
CREATE TABLE limit_events (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    batch INTEGER NOT NULL,
    at_ms BIGINT NOT NULL,
    tokens BIGINT NOT NULL,
    replica TEXT NOT NULL,
    running INTEGER NOT NULL
);
CREATE INDEX limit_events_by_tenant ON limit_events (tenant_id, at_ms);
CREATE INDEX limit_events_running ON limit_events (replica, running);

-- Each tenant's burst bucket (interactive: batch 0; batch work: batch 1), in thousandths of a
-- request, as of `at_ms`.
CREATE TABLE limit_buckets (
    tenant_id TEXT NOT NULL,
    batch INTEGER NOT NULL,
    held_milli BIGINT NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, batch)
);

-- The replicas, each seen a few seconds ago at most while it runs: the concurrency slots of one
-- that stopped being seen no longer count.
CREATE TABLE replicas (
    id TEXT PRIMARY KEY,
    seen_ms BIGINT NOT NULL
);
