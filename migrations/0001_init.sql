-- Tenants, their keys and adapters, and the usage ledger. Shared by SQLite and PostgreSQL:
-- BIGINT integers, DOUBLE PRECISION reals, TEXT strings, times as Unix milliseconds.

CREATE TABLE plans (
    name TEXT PRIMARY KEY,
    -- Prices in micro-dollars per million tokens.
    prompt_price BIGINT NOT NULL,
    cached_prompt_price BIGINT NOT NULL,
    completion_price BIGINT NOT NULL
);

INSERT INTO plans (name, prompt_price, cached_prompt_price, completion_price) VALUES
    ('free', 0, 0, 0),
    ('standard', 500000, 125000, 1500000),
    ('enterprise', 400000, 100000, 1200000);

CREATE TABLE tenants (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    weight DOUBLE PRECISION NOT NULL,
    plan TEXT NOT NULL REFERENCES plans (name),
    requests_per_min BIGINT,
    tokens_per_min BIGINT,
    max_concurrent BIGINT,
    max_adapters BIGINT,
    max_adapter_bytes BIGINT,
    created_at BIGINT NOT NULL,
    deleted_at BIGINT
);

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    -- NULL for keys of the operator (admin scope).
    tenant_id TEXT REFERENCES tenants (id),
    -- SHA-256 of the secret, hex; the secret itself is never stored.
    secret_hash TEXT NOT NULL UNIQUE,
    -- The first characters of the secret, to recognize a key in listings.
    prefix TEXT NOT NULL,
    -- Comma-separated: inference, adapters, admin.
    scopes TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);

CREATE TABLE adapters (
    id TEXT PRIMARY KEY,
    -- The owning tenant; '' for adapters of the operator.
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    version BIGINT NOT NULL,
    public BIGINT NOT NULL DEFAULT 0,
    rank BIGINT NOT NULL,
    targets TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    content_hash TEXT NOT NULL,
    -- Directory of the files, relative to the data directory.
    blob TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    deleted_at BIGINT,
    UNIQUE (owner, name, version)
);

CREATE TABLE usage (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    key_id TEXT NOT NULL,
    -- name@version, or '' for the base model.
    adapter TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    cached_prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    queue_ms DOUBLE PRECISION NOT NULL,
    ttft_ms DOUBLE PRECISION NOT NULL,
    total_ms DOUBLE PRECISION NOT NULL,
    outcome TEXT NOT NULL,
    started_at BIGINT NOT NULL,
    finished_at BIGINT NOT NULL
);

CREATE INDEX usage_by_tenant_time ON usage (tenant_id, finished_at);
CREATE INDEX usage_by_time ON usage (finished_at);
