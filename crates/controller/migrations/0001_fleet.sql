-- The fleet's store: one schema for SQLite and PostgreSQL (portable types only: TEXT,
-- BIGINT). Records that are read whole are JSON documents; the columns beside them are what
-- queries select on. Every write of a migration checks and bumps its revision, so that two
-- controllers on one database never overwrite each other's step.

CREATE TABLE hosts (
    name TEXT PRIMARY KEY,
    site TEXT NOT NULL,
    state TEXT NOT NULL,
    last_seen_ms BIGINT NOT NULL,
    record TEXT NOT NULL
);

CREATE TABLE vms (
    host TEXT NOT NULL,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    PRIMARY KEY (host, name)
);

CREATE TABLE migrations (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    vm TEXT NOT NULL,
    source_host TEXT NOT NULL,
    destination_host TEXT NOT NULL,
    created_ms BIGINT NOT NULL,
    revision BIGINT NOT NULL,
    record TEXT NOT NULL
);

CREATE INDEX migrations_by_state ON migrations (state, source_host);

-- One row: who leads the fleet's migrations, until when (a lease the leader renews).
CREATE TABLE leadership (
    id BIGINT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires_ms BIGINT NOT NULL,
    term BIGINT NOT NULL
);

INSERT INTO leadership (id, holder, expires_ms, term) VALUES (1, '', 0, 0);
