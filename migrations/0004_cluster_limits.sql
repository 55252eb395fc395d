-- Tenant limits that hold across replicas sharing one PostgreSQL database. A server on SQLite
-- keeps its windows in memory and never writes these tables. On PostgreSQL they are made
-- unlogged at start (their contents are worth a minute).

-- Per tenant, class (batch 0: every request; batch 1: batch work, counted in both) and second
-- (Unix seconds): the requests admitted in it and the tokens they hold (reserved, then what
-- they used). A minute's window is the sum of its last sixty seconds.
CREATE TABLE limit_seconds (
    tenant_id TEXT NOT NULL,
    batch INTEGER NOT NULL,
    second BIGINT NOT NULL,
    requests BIGINT NOT NULL,
    tokens BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, batch, second)
);

-- Per tenant, class and replica: the requests holding a concurrency slot. A replica's count
-- stops counting when the replica is no longer seen.
CREATE TABLE limit_running (
    tenant_id TEXT NOT NULL,
    batch INTEGER NOT NULL,
    replica TEXT NOT NULL,
    running BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, batch, replica)
);

-- Each tenant's burst bucket per class, in thousandths of a request, as of `at_ms`.
CREATE TABLE limit_buckets (
    tenant_id TEXT NOT NULL,
    batch INTEGER NOT NULL,
    held_milli BIGINT NOT NULL,
    at_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, batch)
);

-- The replicas, each seen a few seconds ago at most while it runs.
CREATE TABLE replicas (
    id TEXT PRIMARY KEY,
    seen_ms BIGINT NOT NULL
);
