-- Which base model each adapter version was uploaded for: the model's served name, and its
-- shape (the layers and projection sizes an adapter's matrices must fit). An adapter whose shape
-- is not the serving model's cannot be used. Versions recorded before this migration are taken
-- to be for the model of the first start after it.
ALTER TABLE adapters ADD COLUMN base_model TEXT;
ALTER TABLE adapters ADD COLUMN base_shape TEXT;

-- The base model that served each ledger row ('' for rows written before this migration).
ALTER TABLE usage ADD COLUMN base_model TEXT NOT NULL DEFAULT '';

-- Pins that outlive a restart: a holder's pin ('' for the operator, else a tenant's id) of one
-- adapter version, restored in every worker's pool when the server starts.
CREATE TABLE adapter_pins (
    adapter_id TEXT NOT NULL,
    holder TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (adapter_id, holder)
);
