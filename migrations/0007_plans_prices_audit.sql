-- A tenant's own prices over its plan's: each NULL column is the plan's.
CREATE TABLE tenant_prices (
    tenant_id TEXT PRIMARY KEY,
    prompt_price BIGINT,
    cached_prompt_price BIGINT,
    completion_price BIGINT,
    batch_percent BIGINT
);

-- Who changed what, when: every change made through the operator's routes and every change a
-- tenant makes to its keys, adapters, files and batches. `actor` is a tenant's id, or '' for
-- the operator; `tenant_id` the tenant the change is about ('' for none).
CREATE TABLE audit_log (
    id TEXT PRIMARY KEY,
    at BIGINT NOT NULL,
    actor TEXT NOT NULL,
    key_id TEXT NOT NULL,
    tenant_id TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX audit_log_at ON audit_log (at);
CREATE INDEX audit_log_tenant ON audit_log (tenant_id, at);
