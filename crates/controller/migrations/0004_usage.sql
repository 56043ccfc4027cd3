-- What each VM uses, as its host last reported it (docs/policies.md): the planner's demand.
-- JSON ({"cpu_millis": .., "mem_bytes": ..}), or 'null' when the host cannot tell.

ALTER TABLE vms ADD COLUMN usage TEXT NOT NULL DEFAULT 'null';
