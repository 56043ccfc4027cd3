-- The swaps the overload response wants (docs/policies.md "Overload"): its desired state,
-- handed to each VM's host in heartbeat answers. One row per VM; the record is JSON
-- (ferry_api::fleet::SwapPlan). What hosts report they have is in their host record.

CREATE TABLE swap_plans (
    domain TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    record TEXT NOT NULL
);
