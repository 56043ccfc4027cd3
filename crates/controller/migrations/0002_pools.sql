-- Virtual cloud pools (docs/fleet.md): one tenant's layer-2 segment across sites, a VXLAN
-- network identifier and a bridge name each, unique in the fleet.

CREATE TABLE pools (
    name TEXT PRIMARY KEY,
    vni BIGINT NOT NULL UNIQUE,
    bridge TEXT NOT NULL UNIQUE,
    learning BIGINT NOT NULL,
    repoint BIGINT NOT NULL,
    created_ms BIGINT NOT NULL
);

-- Hosts where an operator keeps a pool's endpoint up whether or not its VMs run there.
CREATE TABLE pool_holds (
    pool TEXT NOT NULL,
    host TEXT NOT NULL,
    PRIMARY KEY (pool, host)
);

-- A VM's network interfaces (JSON: mac and bridge of each), which put it in pools.
ALTER TABLE vms ADD COLUMN nics TEXT NOT NULL DEFAULT '[]';
