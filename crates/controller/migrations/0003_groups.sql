-- Groups of migrations that arrive together (docs/fleet.md "Groups"): the members are
-- migrations whose record names the group; the group's decision (released or aborted) is
-- one conditional write here, made once whichever controller makes it.

CREATE TABLE migration_groups (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    created_ms BIGINT NOT NULL,
    decided_ms BIGINT NOT NULL DEFAULT 0,
    reason TEXT NOT NULL DEFAULT '',
    requested_by TEXT NOT NULL,
    members TEXT NOT NULL
);
