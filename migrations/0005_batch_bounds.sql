-- Bounds on a running batch: the bytes of output it has recorded (they count against its
-- tenant's file storage while it runs, as its output files will once it ends), and how many
-- times each line was started (a line started this often whose result was never recorded, its
-- server gone each time, is failed instead of started again).

ALTER TABLE batches ADD COLUMN output_bytes BIGINT NOT NULL DEFAULT 0;

CREATE TABLE batch_tries (
    batch_id TEXT NOT NULL,
    line BIGINT NOT NULL,
    tries BIGINT NOT NULL,
    PRIMARY KEY (batch_id, line)
);
