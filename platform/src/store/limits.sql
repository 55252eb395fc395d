-- The shared limits' decisions, one call each (PostgreSQL only; created at connect). Each takes
-- the tenant's lock first, so the statements after it read what every earlier decision
-- committed. A window is the last sixty seconds of `limit_seconds`: reading it costs the same
-- whatever the tenant's rate. A limit or bucket capacity below zero is none (no parameter is
-- ever NULL: a prepared statement keeps the type its first binding gave each parameter).
--
-- A decision may grant a lease: up to `p_want` admissions (or tokens) at once, counted now,
-- which the replica hands out itself until the current second ends and gives back what it did
-- not use. Each tenant's seconds begin at an offset of their own (0 to 999 ms, from its id;
-- `now_ms` and every second counted are on that clock), so that the leases of many tenants do
-- not all end, and all come back here for the next second, at the same instant. A grant takes at most an eighth of the room left under every limit that applies, so
-- near a limit each request is decided here alone, and far from it one call serves many.
-- An admission's call may lease tokens too (`p_want_tokens`, for the tokens-per-minute limits
-- `p_tpm` and `p_share_tpm`): never refused for them, it grants at most an eighth of the room they
-- have left, so that one call per second serves both kinds of lease; a request whose tokens the
-- lease cannot cover asks `loraplex_limit_reserve_lease`. With `p_ahead` = 1 the leases are for
-- the tenant's next second (counted in it, decided on its window): a replica asks for them
-- shortly before the current second ends, so that steady traffic never waits for a decision.
-- Near a limit (less than eight admissions of room) such a call grants nothing: `near`.
-- (Replicas of earlier releases call `loraplex_limit_admit`, `loraplex_limit_reserve` and
-- `loraplex_limit_admit_lease`; they stay in the database through a rolling update.)

CREATE OR REPLACE FUNCTION loraplex_limit_admit_leases(
    p_tenant TEXT, p_batch INTEGER, p_replica TEXT,
    p_conc BIGINT, p_rpm BIGINT, p_share_conc BIGINT, p_share_rpm BIGINT,
    p_cap DOUBLE PRECISION, p_rate DOUBLE PRECISION, p_window BIGINT, p_timeout BIGINT, p_want BIGINT,
    p_tpm BIGINT, p_share_tpm BIGINT, p_want_tokens BIGINT, p_ahead INTEGER)
RETURNS TABLE (verdict TEXT, now_ms BIGINT, oldest_ms BIGINT, held DOUBLE PRECISION, granted BIGINT, tokens_granted BIGINT)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_real BIGINT; v_now BIGINT; v_sec BIGINT;
    v_req BIGINT; v_old BIGINT; v_breq BIGINT; v_bold BIGINT;
    v_tok BIGINT; v_btok BIGINT;
    v_run BIGINT; v_brun BIGINT;
    v_held DOUBLE PRECISION; v_at BIGINT;
    v_room BIGINT := 1000000000000; v_n BIGINT;
    v_troom BIGINT := 1000000000000000; v_t BIGINT := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('limits:' || p_tenant));
    v_real := CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT);
    v_now := v_real + (hashtext('second:' || p_tenant) & 1023) % 1000;
    v_sec := v_now / 1000 + p_ahead;
    SELECT COALESCE(SUM(s.requests) FILTER (WHERE s.batch = 0), 0), MIN(s.second) FILTER (WHERE s.batch = 0 AND s.requests > 0),
           COALESCE(SUM(s.requests) FILTER (WHERE s.batch = 1), 0), MIN(s.second) FILTER (WHERE s.batch = 1 AND s.requests > 0),
           COALESCE(SUM(s.tokens) FILTER (WHERE s.batch = 0), 0), COALESCE(SUM(s.tokens) FILTER (WHERE s.batch = 1), 0)
      INTO v_req, v_old, v_breq, v_bold, v_tok, v_btok
      FROM limit_seconds s WHERE s.tenant_id = p_tenant AND s.second > v_sec - p_window / 1000;
    SELECT COALESCE(SUM(n.running) FILTER (WHERE n.batch = 0), 0), COALESCE(SUM(n.running) FILTER (WHERE n.batch = 1), 0)
      INTO v_run, v_brun
      FROM limit_running n JOIN replicas r ON r.id = n.replica
     WHERE n.tenant_id = p_tenant AND r.seen_ms > v_real - p_timeout;
    IF p_conc >= 0 AND v_run >= p_conc THEN
        RETURN QUERY SELECT 'concurrent', v_now, CAST(NULL AS BIGINT), CAST(NULL AS DOUBLE PRECISION), CAST(0 AS BIGINT), CAST(0 AS BIGINT); RETURN;
    END IF;
    IF p_rpm >= 0 AND v_req >= p_rpm THEN
        RETURN QUERY SELECT 'rpm', v_now, v_old * 1000, CAST(NULL AS DOUBLE PRECISION), CAST(0 AS BIGINT), CAST(0 AS BIGINT); RETURN;
    END IF;
    IF p_batch = 1 AND p_share_conc >= 0 AND v_brun >= p_share_conc THEN
        RETURN QUERY SELECT 'share_concurrent', v_now, CAST(NULL AS BIGINT), CAST(NULL AS DOUBLE PRECISION), CAST(0 AS BIGINT), CAST(0 AS BIGINT); RETURN;
    END IF;
    IF p_batch = 1 AND p_share_rpm >= 0 AND v_breq >= p_share_rpm THEN
        RETURN QUERY SELECT 'share_rpm', v_now, v_bold * 1000, CAST(NULL AS DOUBLE PRECISION), CAST(0 AS BIGINT), CAST(0 AS BIGINT); RETURN;
    END IF;
    IF p_cap >= 0 THEN
        SELECT b.held_milli / 1000.0, b.at_ms INTO v_held, v_at FROM limit_buckets b WHERE b.tenant_id = p_tenant AND b.batch = p_batch;
        IF NOT FOUND THEN
            v_held := p_cap;
            v_at := v_now;
        END IF;
        v_held := LEAST(p_cap, v_held + GREATEST(v_now - v_at, 0) / 1000.0 * p_rate);
        IF v_held < 1 THEN
            RETURN QUERY SELECT 'bucket', v_now, CAST(NULL AS BIGINT), v_held, CAST(0 AS BIGINT), CAST(0 AS BIGINT); RETURN;
        END IF;
    END IF;
    -- The lease: what every limit still has room for, an eighth of it, at least this request.
    IF p_conc >= 0 THEN v_room := LEAST(v_room, p_conc - v_run); END IF;
    IF p_rpm >= 0 THEN v_room := LEAST(v_room, p_rpm - v_req); END IF;
    IF p_batch = 1 AND p_share_conc >= 0 THEN v_room := LEAST(v_room, p_share_conc - v_brun); END IF;
    IF p_batch = 1 AND p_share_rpm >= 0 THEN v_room := LEAST(v_room, p_share_rpm - v_breq); END IF;
    IF p_cap >= 0 THEN v_room := LEAST(v_room, CAST(FLOOR(v_held) AS BIGINT)); END IF;
    -- Asked ahead, near a limit: nothing, so that every request there is decided as it comes.
    IF p_ahead = 1 AND v_room < 8 THEN
        RETURN QUERY SELECT 'near', v_now, CAST(NULL AS BIGINT), CAST(NULL AS DOUBLE PRECISION), CAST(0 AS BIGINT), CAST(0 AS BIGINT); RETURN;
    END IF;
    v_n := GREATEST(1, LEAST(p_want, v_room / 8));
    IF p_cap >= 0 THEN
        v_held := v_held - v_n;
        INSERT INTO limit_buckets (tenant_id, batch, held_milli, at_ms) VALUES (p_tenant, p_batch, CAST(FLOOR(v_held * 1000) AS BIGINT), v_now)
            ON CONFLICT (tenant_id, batch) DO UPDATE SET held_milli = excluded.held_milli, at_ms = excluded.at_ms;
    END IF;
    -- Tokens: an eighth of what every token limit has left, up to what was asked; none without one.
    IF p_want_tokens > 0 AND (p_tpm >= 0 OR (p_batch = 1 AND p_share_tpm >= 0)) THEN
        IF p_tpm >= 0 THEN v_troom := LEAST(v_troom, p_tpm - v_tok); END IF;
        IF p_batch = 1 AND p_share_tpm >= 0 THEN v_troom := LEAST(v_troom, p_share_tpm - v_btok); END IF;
        v_t := GREATEST(0, LEAST(p_want_tokens, v_troom / 8));
    END IF;
    -- Counted in its class, and batch work in the tenant's total too.
    INSERT INTO limit_seconds (tenant_id, batch, second, requests, tokens) VALUES (p_tenant, 0, v_sec, v_n, v_t)
        ON CONFLICT (tenant_id, batch, second) DO UPDATE SET requests = limit_seconds.requests + v_n, tokens = limit_seconds.tokens + v_t;
    INSERT INTO limit_running (tenant_id, batch, replica, running) VALUES (p_tenant, 0, p_replica, v_n)
        ON CONFLICT (tenant_id, batch, replica) DO UPDATE SET running = limit_running.running + v_n;
    IF p_batch = 1 THEN
        INSERT INTO limit_seconds (tenant_id, batch, second, requests, tokens) VALUES (p_tenant, 1, v_sec, v_n, v_t)
            ON CONFLICT (tenant_id, batch, second) DO UPDATE SET requests = limit_seconds.requests + v_n, tokens = limit_seconds.tokens + v_t;
        INSERT INTO limit_running (tenant_id, batch, replica, running) VALUES (p_tenant, 1, p_replica, v_n)
            ON CONFLICT (tenant_id, batch, replica) DO UPDATE SET running = limit_running.running + v_n;
    END IF;
    RETURN QUERY SELECT 'ok', v_now, CAST(NULL AS BIGINT), v_held, v_n, v_t;
END
$fn$;

CREATE OR REPLACE FUNCTION loraplex_limit_reserve_lease(
    p_tenant TEXT, p_batch INTEGER, p_tokens BIGINT, p_max BIGINT, p_share_max BIGINT, p_window BIGINT, p_want BIGINT)
RETURNS TABLE (verdict TEXT, now_ms BIGINT, held BIGINT, granted BIGINT)
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    v_real BIGINT; v_now BIGINT; v_sec BIGINT;
    v_all BIGINT; v_batch BIGINT;
    v_room BIGINT := 1000000000000000; v_n BIGINT;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('limits:' || p_tenant));
    v_real := CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT);
    v_now := v_real + (hashtext('second:' || p_tenant) & 1023) % 1000;
    v_sec := v_now / 1000;
    SELECT COALESCE(SUM(s.tokens) FILTER (WHERE s.batch = 0), 0), COALESCE(SUM(s.tokens) FILTER (WHERE s.batch = 1), 0) INTO v_all, v_batch
      FROM limit_seconds s WHERE s.tenant_id = p_tenant AND s.second > v_sec - p_window / 1000;
    IF p_batch = 1 AND p_share_max >= 0 AND v_batch + p_tokens > p_share_max THEN
        RETURN QUERY SELECT 'share', v_now, v_batch, CAST(0 AS BIGINT); RETURN;
    END IF;
    IF p_max >= 0 AND v_all + p_tokens > p_max THEN
        RETURN QUERY SELECT 'all', v_now, v_all, CAST(0 AS BIGINT); RETURN;
    END IF;
    -- This request's tokens, and a lease of an eighth of the room left after them.
    IF p_max >= 0 THEN v_room := LEAST(v_room, p_max - v_all - p_tokens); END IF;
    IF p_batch = 1 AND p_share_max >= 0 THEN v_room := LEAST(v_room, p_share_max - v_batch - p_tokens); END IF;
    v_n := p_tokens + GREATEST(0, LEAST(p_want - p_tokens, v_room / 8));
    INSERT INTO limit_seconds (tenant_id, batch, second, requests, tokens) VALUES (p_tenant, 0, v_sec, 0, v_n)
        ON CONFLICT (tenant_id, batch, second) DO UPDATE SET tokens = limit_seconds.tokens + v_n;
    IF p_batch = 1 THEN
        INSERT INTO limit_seconds (tenant_id, batch, second, requests, tokens) VALUES (p_tenant, 1, v_sec, 0, v_n)
            ON CONFLICT (tenant_id, batch, second) DO UPDATE SET tokens = limit_seconds.tokens + v_n;
    END IF;
    RETURN QUERY SELECT 'ok', v_now, v_all, v_n;
END
$fn$;
