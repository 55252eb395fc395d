-- The ledger keeps history and money exact: each usage row carries the plan and the prices in
-- force when it was written (so a later plan change never rewrites a past bill), and the
-- instance of the server that wrote it. A request is recorded when it is admitted, with the
-- outcome 'running', and completed when it ends; a row still 'running' when its server starts
-- again was cut short by a crash and becomes 'interrupted'.

ALTER TABLE usage ADD COLUMN plan TEXT NOT NULL DEFAULT '';
ALTER TABLE usage ADD COLUMN prompt_price BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage ADD COLUMN cached_prompt_price BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage ADD COLUMN completion_price BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage ADD COLUMN instance TEXT NOT NULL DEFAULT '';

-- Rows written before this migration are priced by their tenant's plan as it is now, which is
-- how reports priced them until here.
UPDATE usage SET
    plan = COALESCE((SELECT t.plan FROM tenants t WHERE t.id = usage.tenant_id), ''),
    prompt_price = COALESCE((SELECT p.prompt_price FROM tenants t JOIN plans p ON p.name = t.plan WHERE t.id = usage.tenant_id), 0),
    cached_prompt_price = COALESCE((SELECT p.cached_prompt_price FROM tenants t JOIN plans p ON p.name = t.plan WHERE t.id = usage.tenant_id), 0),
    completion_price = COALESCE((SELECT p.completion_price FROM tenants t JOIN plans p ON p.name = t.plan WHERE t.id = usage.tenant_id), 0);

CREATE INDEX usage_running ON usage (instance) WHERE outcome = 'running';

-- Pages of the device pool a tenant may keep pinned with adapter loads; NULL is the server's
-- default.
ALTER TABLE tenants ADD COLUMN max_pinned_pages BIGINT;
