-- The OpenAI Batch API: the files a tenant uploads (and the output files of its batches), the
-- batches, and the result of each line of a batch while it runs. Batch work is billed at a
-- share of the plan's prices.

-- Percent of the plan's prices that a token of batch work costs.
ALTER TABLE plans ADD COLUMN batch_percent BIGINT NOT NULL DEFAULT 50;

-- The batch a usage row is a line of; '' for interactive requests.
ALTER TABLE usage ADD COLUMN batch_id TEXT NOT NULL DEFAULT '';
CREATE INDEX usage_by_batch ON usage (batch_id) WHERE batch_id <> '';

CREATE TABLE files (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    -- 'batch' (uploaded input), 'batch_output' (written by a batch: its output or its errors).
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    -- Lines of JSON in it.
    lines BIGINT NOT NULL,
    -- Where its bytes are, relative to the data directory.
    path TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    deleted_at BIGINT
);

CREATE INDEX files_by_tenant ON files (tenant_id, created_at);

CREATE TABLE batches (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    -- The key that created it: its lines are recorded on the ledger under this key.
    key_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    -- validating, in_progress, finalizing, completed, failed, expired, cancelling, cancelled.
    status TEXT NOT NULL,
    -- The server instance that runs it.
    instance TEXT NOT NULL,
    -- A JSON object of the client's labels.
    metadata TEXT NOT NULL,
    -- Lines of the input file; and, once the batch has ended, how many succeeded and failed
    -- (while it runs they are counted in batch_results).
    total BIGINT NOT NULL,
    completed BIGINT NOT NULL DEFAULT 0,
    failed BIGINT NOT NULL DEFAULT 0,
    output_file_id TEXT,
    error_file_id TEXT,
    -- Why the whole batch failed, as a JSON list of OpenAI's batch errors.
    errors TEXT,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    in_progress_at BIGINT,
    finalizing_at BIGINT,
    completed_at BIGINT,
    failed_at BIGINT,
    expired_at BIGINT,
    cancelling_at BIGINT,
    cancelled_at BIGINT
);

CREATE INDEX batches_by_tenant ON batches (tenant_id, created_at);
CREATE INDEX batches_active ON batches (instance, status);

-- One row per finished line of a running batch: a line is done once its row is here. The rows
-- become the output and error files when the batch ends, and are deleted then.
CREATE TABLE batch_results (
    batch_id TEXT NOT NULL,
    line BIGINT NOT NULL,
    -- 1: the request succeeded (a line of the output file); 0: it failed (the error file).
    ok BIGINT NOT NULL,
    -- The line of the output or error file, JSON.
    body TEXT NOT NULL,
    -- The usage row that bills it ('' when the request failed before it was admitted).
    usage_id TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
