//! The fleet's store: hosts, their VMs, migrations and the leader's lease, in SQLite (one file,
//! the default) or PostgreSQL (several controllers sharing a fleet), through sqlx's `Any`
//! driver with one set of schema migrations (`migrations/`) for both.
//!
//! A migration is a JSON document with the columns queries select on beside it. Every change
//! goes through [`Store::update_migration`]: read, change, write back only if nobody else wrote
//! in between (the revision column), else read again. That is what lets two controllers share
//! one database without a lost or repeated step.

use std::time::{SystemTime, UNIX_EPOCH};

use ferry_api::fleet::{
    FleetMigration, FleetMigrationState, GroupState, Heartbeat, Host, HostState, Site, SwapPlan,
    Vm, VmKind,
};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};

/// How often an optimistic update is retried before giving up (each retry means another
/// controller wrote the same migration in between: a handful at most).
const UPDATE_ATTEMPTS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the store {url}")]
    Open { url: String, source: sqlx::Error },
    #[error("cannot bring the store's schema up to date")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("the store failed")]
    Database(#[from] sqlx::Error),
    #[error("the store holds a record it cannot read ({what}): {message}")]
    Corrupt { what: String, message: String },
    #[error("migration {0} kept changing under this controller; try again")]
    Contended(String),
}

/// Which database the store is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Sqlite,
    Postgres,
}

impl StoreKind {
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Sqlite => "sqlite",
            StoreKind::Postgres => "postgres",
        }
    }
}

/// A pool as stored: its identity and the hosts where it is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRecord {
    pub name: String,
    pub vni: u32,
    pub bridge: String,
    pub learning: bool,
    pub repoint: bool,
    pub held: Vec<String>,
}

/// A group as stored: its members (migration ids, in the order asked) and its decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord {
    pub id: String,
    pub state: GroupState,
    pub reason: Option<String>,
    pub requested_by: String,
    pub created_unix_ms: u64,
    pub decided_unix_ms: Option<u64>,
    pub members: Vec<String>,
}

/// The fleet's store.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    kind: StoreKind,
}

/// Milliseconds since the epoch, the store's clock (each controller's own: leases assume
/// clocks agree within a fraction of the lease, as NTP keeps them).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn db_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn db_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn corrupt(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        what: what.to_owned(),
        message: e.to_string(),
    }
}

impl Store {
    /// Opens the store `database` names, a `postgres://` URL or a SQLite file's path (made if
    /// missing), and brings its schema up to date.
    pub async fn open(database: &str) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        let (url, kind, connections) =
            if database.starts_with("postgres://") || database.starts_with("postgresql://") {
                (database.to_owned(), StoreKind::Postgres, 8)
            } else {
                let path = database.strip_prefix("sqlite://").unwrap_or(database);
                if let Some(dir) = std::path::Path::new(path).parent() {
                    if !dir.as_os_str().is_empty() {
                        std::fs::create_dir_all(dir).map_err(|e| StoreError::Open {
                            url: database.to_owned(),
                            source: sqlx::Error::Io(e),
                        })?;
                    }
                }
                // One connection: SQLite takes one writer at a time anyway, and a single
                // connection never waits on its own lock.
                (format!("sqlite://{path}?mode=rwc"), StoreKind::Sqlite, 1)
            };
        let pool = AnyPoolOptions::new()
            .max_connections(connections)
            .connect(&url)
            .await
            .map_err(|source| StoreError::Open {
                url: redact(&url),
                source,
            })?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        Ok(Store { pool, kind })
    }

    pub fn kind(&self) -> StoreKind {
        self.kind
    }

    /// Records a host's heartbeat: the host is up, its facts and its VMs are what it says.
    pub async fn record_heartbeat(
        &self,
        name: &str,
        beat: &Heartbeat,
        now: u64,
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let first_seen = sqlx::query("SELECT record FROM hosts WHERE name = $1")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?
            .map(|row| host_from(&row).map(|h| h.first_seen_unix_ms))
            .transpose()?
            .unwrap_or(now);
        let host = Host {
            name: name.to_owned(),
            site: beat.site.clone(),
            state: HostState::Up,
            version: beat.version.clone(),
            peer_listen: beat.peer_listen.clone(),
            peers: beat.peers.clone(),
            max_outgoing: beat.max_outgoing,
            vms: u32::try_from(beat.vms.len()).unwrap_or(u32::MAX),
            first_seen_unix_ms: first_seen,
            last_seen_unix_ms: now,
            overlay: beat.overlay.clone(),
            vms_listed_unix_ms: beat.vms_listed_unix_ms,
            capacity: beat.capacity,
            swaps: beat.swaps.clone(),
        };
        let record = serde_json::to_string(&host).map_err(|e| corrupt("host", e))?;
        sqlx::query(
            "INSERT INTO hosts (name, site, state, last_seen_ms, record) VALUES ($1, $2, 'up', $3, $4)
             ON CONFLICT (name) DO UPDATE SET site = $2, state = 'up', last_seen_ms = $3, record = $4",
        )
        .bind(name)
        .bind(&beat.site)
        .bind(db_i64(now))
        .bind(&record)
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM vms WHERE host = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        for vm in &beat.vms {
            let nics = serde_json::to_string(&vm.nics).map_err(|e| corrupt("vm nics", e))?;
            let usage = serde_json::to_string(&vm.usage).map_err(|e| corrupt("vm usage", e))?;
            sqlx::query(
                "INSERT INTO vms (host, name, kind, state, nics, usage) VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(name)
            .bind(&vm.name)
            .bind(vm.kind.name())
            .bind(&vm.state)
            .bind(&nics)
            .bind(&usage)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Marks down the hosts not heard from since `seen_before`; returns their names.
    pub async fn mark_hosts_down(&self, seen_before: u64) -> Result<Vec<String>, StoreError> {
        let rows = sqlx::query(
            "UPDATE hosts SET state = 'down' WHERE state = 'up' AND last_seen_ms < $1 RETURNING name",
        )
        .bind(db_i64(seen_before))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| r.try_get::<String, _>(0).map_err(StoreError::from))
            .collect()
    }

    /// The swaps the overload response wants, every host's or one host's.
    pub async fn swap_plans(&self, host: Option<&str>) -> Result<Vec<SwapPlan>, StoreError> {
        let rows = match host {
            Some(host) => {
                sqlx::query("SELECT record FROM swap_plans WHERE host = $1 ORDER BY domain")
                    .bind(host)
                    .fetch_all(&self.pool)
                    .await?
            }
            None => {
                sqlx::query("SELECT record FROM swap_plans ORDER BY domain")
                    .fetch_all(&self.pool)
                    .await?
            }
        };
        rows.iter()
            .map(|row| {
                let record: String = row.try_get(0)?;
                serde_json::from_str(&record).map_err(|e| corrupt("swap plan", e))
            })
            .collect()
    }

    /// Wants `plan` (a VM has one swap at most: it replaces the VM's last).
    pub async fn put_swap_plan(&self, plan: &SwapPlan) -> Result<(), StoreError> {
        let record = serde_json::to_string(plan).map_err(|e| corrupt("swap plan", e))?;
        sqlx::query(
            "INSERT INTO swap_plans (domain, host, record) VALUES ($1, $2, $3)
             ON CONFLICT (domain) DO UPDATE SET host = $2, record = $3",
        )
        .bind(&plan.domain)
        .bind(&plan.host)
        .bind(&record)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// No longer wants a swap for `domain`: its host gives it back.
    pub async fn delete_swap_plan(&self, domain: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM swap_plans WHERE domain = $1")
            .bind(domain)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn hosts(&self) -> Result<Vec<Host>, StoreError> {
        let rows = sqlx::query("SELECT record, state FROM hosts ORDER BY name")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(host_from).collect()
    }

    pub async fn host(&self, name: &str) -> Result<Option<Host>, StoreError> {
        sqlx::query("SELECT record, state FROM hosts WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?
            .map(|row| host_from(&row))
            .transpose()
    }

    pub async fn vms(&self) -> Result<Vec<Vm>, StoreError> {
        let rows = sqlx::query(
            "SELECT vms.name, vms.kind, vms.host, hosts.site, vms.state, vms.nics, vms.usage FROM vms
             JOIN hosts ON hosts.name = vms.host ORDER BY vms.name, vms.host",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let kind: String = row.try_get(1)?;
                let nics: String = row.try_get(5)?;
                let usage: String = row.try_get(6)?;
                Ok(Vm {
                    usage: serde_json::from_str(&usage).map_err(|e| corrupt("vm usage", e))?,
                    nics: serde_json::from_str(&nics).map_err(|e| corrupt("vm nics", e))?,
                    name: row.try_get(0)?,
                    kind: VmKind::parse(&kind).ok_or_else(|| corrupt("vm kind", &kind))?,
                    host: row.try_get(2)?,
                    site: row.try_get(3)?,
                    state: row.try_get(4)?,
                })
            })
            .collect()
    }

    /// Stores a new pool; false when its name, VNI or bridge is taken.
    pub async fn insert_pool(&self, pool: &PoolRecord, now: u64) -> Result<bool, StoreError> {
        let written = sqlx::query(
            "INSERT INTO pools (name, vni, bridge, learning, repoint, created_ms)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
        )
        .bind(&pool.name)
        .bind(i64::from(pool.vni))
        .bind(&pool.bridge)
        .bind(i64::from(pool.learning))
        .bind(i64::from(pool.repoint))
        .bind(db_i64(now))
        .execute(&self.pool)
        .await?;
        Ok(written.rows_affected() == 1)
    }

    pub async fn delete_pool(&self, name: &str) -> Result<bool, StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM pool_holds WHERE pool = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        let deleted = sqlx::query("DELETE FROM pools WHERE name = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(deleted.rows_affected() == 1)
    }

    /// Every pool with its holds, by name.
    pub async fn pools(&self) -> Result<Vec<PoolRecord>, StoreError> {
        let rows =
            sqlx::query("SELECT name, vni, bridge, learning, repoint FROM pools ORDER BY name")
                .fetch_all(&self.pool)
                .await?;
        let holds = sqlx::query("SELECT pool, host FROM pool_holds ORDER BY host")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|row| {
                let name: String = row.try_get(0)?;
                let vni: i64 = row.try_get(1)?;
                let held = holds
                    .iter()
                    .filter(|h| h.try_get::<String, _>(0).is_ok_and(|p| p == name))
                    .map(|h| h.try_get::<String, _>(1))
                    .collect::<Result<_, _>>()?;
                Ok(PoolRecord {
                    vni: u32::try_from(vni).map_err(|e| corrupt("pool vni", e))?,
                    bridge: row.try_get(2)?,
                    learning: row.try_get::<i64, _>(3)? != 0,
                    repoint: row.try_get::<i64, _>(4)? != 0,
                    name,
                    held,
                })
            })
            .collect()
    }

    /// Keeps (`hold`) or stops keeping a pool's endpoint on a host.
    pub async fn set_hold(&self, pool: &str, host: &str, hold: bool) -> Result<(), StoreError> {
        let query = if hold {
            "INSERT INTO pool_holds (pool, host) VALUES ($1, $2) ON CONFLICT DO NOTHING"
        } else {
            "DELETE FROM pool_holds WHERE pool = $1 AND host = $2"
        };
        sqlx::query(query)
            .bind(pool)
            .bind(host)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The sites, from their hosts, counting `vms` (each VM where it runs).
    pub async fn sites(&self, vms: Vec<Vm>) -> Result<Vec<Site>, StoreError> {
        let hosts = self.hosts().await?;
        let mut sites: Vec<Site> = Vec::new();
        for host in hosts {
            let site = match sites.iter_mut().find(|s| s.name == host.site) {
                Some(site) => site,
                None => {
                    sites.push(Site {
                        name: host.site.clone(),
                        hosts: 0,
                        hosts_up: 0,
                        vms: 0,
                    });
                    sites.last_mut().expect("just pushed")
                }
            };
            site.hosts += 1;
            site.hosts_up += u32::from(host.state == HostState::Up);
        }
        for vm in vms {
            if let Some(site) = sites.iter_mut().find(|s| s.name == vm.site) {
                site.vms += 1;
            }
        }
        sites.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(sites)
    }

    pub async fn insert_migration(&self, m: &FleetMigration) -> Result<(), StoreError> {
        insert_migration(m)?.execute(&self.pool).await?;
        Ok(())
    }

    /// Stores a new group and its member migrations, all or nothing.
    pub async fn insert_group(
        &self,
        group: &GroupRecord,
        members: &[FleetMigration],
    ) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO migration_groups (id, state, created_ms, requested_by, members)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&group.id)
        .bind(group.state.name())
        .bind(db_i64(group.created_unix_ms))
        .bind(&group.requested_by)
        .bind(serde_json::to_string(&group.members).map_err(|e| corrupt("group", e))?)
        .execute(&mut *tx)
        .await?;
        for m in members {
            insert_migration(m)?.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Every group, oldest first.
    pub async fn groups(&self) -> Result<Vec<GroupRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, state, created_ms, decided_ms, reason, requested_by, members
             FROM migration_groups ORDER BY created_ms, id",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let state: String = row.try_get(1)?;
                let decided: i64 = row.try_get(3)?;
                let reason: String = row.try_get(4)?;
                let members: String = row.try_get(6)?;
                Ok(GroupRecord {
                    id: row.try_get(0)?,
                    state: GroupState::parse(&state)
                        .ok_or_else(|| corrupt("group state", &state))?,
                    created_unix_ms: db_u64(row.try_get(2)?),
                    decided_unix_ms: (decided > 0).then(|| db_u64(decided)),
                    reason: (!reason.is_empty()).then_some(reason),
                    requested_by: row.try_get(5)?,
                    members: serde_json::from_str(&members)
                        .map_err(|e| corrupt("group members", e))?,
                })
            })
            .collect()
    }

    /// Decides open group `id` (released or aborted, for `reason`); false when it was decided
    /// already (by this controller or another).
    pub async fn decide_group(
        &self,
        id: &str,
        state: GroupState,
        reason: &str,
        now: u64,
    ) -> Result<bool, StoreError> {
        let written = sqlx::query(
            "UPDATE migration_groups SET state = $1, decided_ms = $2, reason = $3
             WHERE id = $4 AND state = $5",
        )
        .bind(state.name())
        .bind(db_i64(now))
        .bind(reason)
        .bind(id)
        .bind(GroupState::Open.name())
        .execute(&self.pool)
        .await?;
        Ok(written.rows_affected() == 1)
    }

    pub async fn migration(&self, id: &str) -> Result<Option<FleetMigration>, StoreError> {
        Ok(self.migration_with_revision(id).await?.map(|(m, _)| m))
    }

    async fn migration_with_revision(
        &self,
        id: &str,
    ) -> Result<Option<(FleetMigration, i64)>, StoreError> {
        sqlx::query("SELECT record, revision FROM migrations WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .map(|row| Ok((migration_from(&row)?, row.try_get::<i64, _>(1)?)))
            .transpose()
    }

    /// Every migration, oldest first.
    pub async fn migrations(&self) -> Result<Vec<FleetMigration>, StoreError> {
        let rows = sqlx::query("SELECT record FROM migrations ORDER BY created_ms, id")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(migration_from).collect()
    }

    /// Migrations in `state`, oldest first; only those from `source_host` when given.
    pub async fn migrations_in(
        &self,
        state: FleetMigrationState,
        source_host: Option<&str>,
    ) -> Result<Vec<FleetMigration>, StoreError> {
        let rows = match source_host {
            Some(host) => {
                sqlx::query(
                    "SELECT record FROM migrations WHERE state = $1 AND source_host = $2 ORDER BY created_ms, id",
                )
                .bind(state.name())
                .bind(host)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(
                    "SELECT record FROM migrations WHERE state = $1 ORDER BY created_ms, id",
                )
                .bind(state.name())
                .fetch_all(&self.pool)
                .await?
            }
        };
        rows.iter().map(migration_from).collect()
    }

    /// Changes migration `id` with `change`, which returns whether it changed anything; writes
    /// it back only if no one else wrote it since it was read (else reads again). Returns the
    /// migration as stored after, or None when there is no such migration.
    pub async fn update_migration(
        &self,
        id: &str,
        mut change: impl FnMut(&mut FleetMigration) -> bool,
    ) -> Result<Option<FleetMigration>, StoreError> {
        for _ in 0..UPDATE_ATTEMPTS {
            let Some((mut m, revision)) = self.migration_with_revision(id).await? else {
                return Ok(None);
            };
            if !change(&mut m) {
                return Ok(Some(m));
            }
            m.updated_unix_ms = now_ms();
            if self.write_migration(&m, revision).await? {
                return Ok(Some(m));
            }
        }
        Err(StoreError::Contended(id.to_owned()))
    }

    /// Writes `m` if its stored revision is still `revision`; returns whether it did.
    async fn write_migration(&self, m: &FleetMigration, revision: i64) -> Result<bool, StoreError> {
        let written = sqlx::query(
            "UPDATE migrations SET state = $1, revision = revision + 1, record = $2
             WHERE id = $3 AND revision = $4",
        )
        .bind(m.state.name())
        .bind(serde_json::to_string(m).map_err(|e| corrupt("migration", e))?)
        .bind(&m.id)
        .bind(revision)
        .execute(&self.pool)
        .await?;
        Ok(written.rows_affected() == 1)
    }

    /// Takes or renews the leader's lease for `me` until `now + lease_ms`, if nobody else
    /// holds an unexpired one. Returns whether `me` leads.
    pub async fn try_lead(&self, me: &str, now: u64, lease_ms: u64) -> Result<bool, StoreError> {
        // A new holder starts a new term; the holder renewing keeps its term.
        let written = sqlx::query(
            "UPDATE leadership SET
                 term = CASE WHEN holder = $1 THEN term ELSE term + 1 END,
                 holder = $1, expires_ms = $2
             WHERE id = 1 AND (holder = $1 OR expires_ms < $3)",
        )
        .bind(me)
        .bind(db_i64(now + lease_ms))
        .bind(db_i64(now))
        .execute(&self.pool)
        .await?;
        Ok(written.rows_affected() == 1)
    }

    /// Gives up the lease if `me` holds it (a controller shutting down).
    pub async fn resign(&self, me: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE leadership SET expires_ms = 0 WHERE id = 1 AND holder = $1")
            .bind(me)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Who holds an unexpired lease now.
    pub async fn leader(&self, now: u64) -> Result<Option<String>, StoreError> {
        let row = sqlx::query("SELECT holder, expires_ms FROM leadership WHERE id = 1")
            .fetch_one(&self.pool)
            .await?;
        let (holder, expires): (String, i64) = (row.try_get(0)?, row.try_get(1)?);
        Ok((db_u64(expires) >= now && !holder.is_empty()).then_some(holder))
    }
}

/// The statement that stores a new migration.
fn insert_migration(
    m: &FleetMigration,
) -> Result<sqlx::query::Query<'_, sqlx::Any, sqlx::any::AnyArguments<'_>>, StoreError> {
    Ok(sqlx::query(
        "INSERT INTO migrations (id, state, vm, source_host, destination_host, created_ms, revision, record)
         VALUES ($1, $2, $3, $4, $5, $6, 0, $7)",
    )
    .bind(&m.id)
    .bind(m.state.name())
    .bind(&m.vm)
    .bind(&m.source_host)
    .bind(&m.destination_host)
    .bind(db_i64(m.created_unix_ms))
    .bind(serde_json::to_string(m).map_err(|e| corrupt("migration", e))?))
}

fn host_from(row: &AnyRow) -> Result<Host, StoreError> {
    let record: String = row.try_get(0)?;
    let mut host: Host = serde_json::from_str(&record).map_err(|e| corrupt("host", e))?;
    // The state column is the truth: marking down does not rewrite the record.
    if let Ok(state) = row.try_get::<String, _>(1) {
        host.state = if state == "up" {
            HostState::Up
        } else {
            HostState::Down
        };
    }
    Ok(host)
}

fn migration_from(row: &AnyRow) -> Result<FleetMigration, StoreError> {
    let record: String = row.try_get(0)?;
    serde_json::from_str(&record).map_err(|e| corrupt("migration", e))
}

/// A database URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ferry_api::fleet::VmReport;
    use ferry_api::settings::MigrationSettings;

    fn beat(site: &str, vms: &[&str]) -> Heartbeat {
        Heartbeat {
            site: site.into(),
            version: "test".into(),
            peer_listen: "127.0.0.1:1".into(),
            peers: vec![],
            max_outgoing: 4,
            vms: vms
                .iter()
                .map(|n| VmReport {
                    name: (*n).into(),
                    kind: VmKind::Libvirt,
                    state: "running".into(),
                    usage: None,
                    nics: vec![],
                })
                .collect(),
            migrations: vec![],
            overlay: None,
            vms_listed_unix_ms: None,
            wait_ms: None,
            capacity: None,
            swaps: vec![],
        }
    }

    pub(crate) fn migration(id: &str) -> FleetMigration {
        FleetMigration {
            id: id.into(),
            vm: "vm1".into(),
            kind: VmKind::Libvirt,
            source_host: "a1".into(),
            destination_host: "b1".into(),
            state: FleetMigrationState::Requested,
            error: None,
            requested_by: "test".into(),
            copy_storage: false,
            settings: MigrationSettings::default(),
            created_unix_ms: now_ms(),
            updated_unix_ms: now_ms(),
            finished_unix_ms: None,
            cancel_requested: false,
            nics: vec![],
            group: None,
            held_unix_ms: None,
            planned: None,
            agent: None,
            timeline: vec![],
        }
    }

    async fn store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet.db");
        let store = Store::open(path.to_str().unwrap()).await.unwrap();
        (dir, store)
    }

    #[tokio::test]
    async fn heartbeats_make_hosts_sites_and_vms_and_silence_marks_hosts_down() {
        let (_dir, store) = store().await;
        store
            .record_heartbeat("a1", &beat("a", &["vm1", "vm2"]), 1000)
            .await
            .unwrap();
        store
            .record_heartbeat("b1", &beat("b", &[]), 1500)
            .await
            .unwrap();
        // A later heartbeat replaces the VM list (vm2 left) and keeps the first sighting.
        store
            .record_heartbeat("a1", &beat("a", &["vm1"]), 2000)
            .await
            .unwrap();
        let hosts = store.hosts().await.unwrap();
        assert_eq!(hosts.len(), 2);
        assert_eq!(hosts[0].first_seen_unix_ms, 1000);
        assert_eq!(hosts[0].last_seen_unix_ms, 2000);
        let vms = store.vms().await.unwrap();
        assert_eq!(vms.len(), 1);
        assert_eq!((vms[0].host.as_str(), vms[0].site.as_str()), ("a1", "a"));
        assert_eq!(store.mark_hosts_down(1800).await.unwrap(), vec!["b1"]);
        assert_eq!(
            store.mark_hosts_down(1800).await.unwrap(),
            Vec::<String>::new()
        );
        let sites = store.sites(store.vms().await.unwrap()).await.unwrap();
        assert_eq!(
            sites
                .iter()
                .map(|s| (s.name.as_str(), s.hosts, s.hosts_up, s.vms))
                .collect::<Vec<_>>(),
            vec![("a", 1, 1, 1), ("b", 1, 0, 0)]
        );
        // A heartbeat brings a host back.
        store
            .record_heartbeat("b1", &beat("b", &[]), 3000)
            .await
            .unwrap();
        assert_eq!(
            store.host("b1").await.unwrap().unwrap().state,
            HostState::Up
        );
    }

    #[tokio::test]
    async fn a_migration_changes_only_through_its_revision() {
        let (_dir, store) = store().await;
        store.insert_migration(&migration("m1")).await.unwrap();
        let m = store
            .update_migration("m1", |m| {
                m.state = FleetMigrationState::Scheduled;
                true
            })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(m.state, FleetMigrationState::Scheduled);
        // A change that decides nothing changes writes nothing.
        store.update_migration("m1", |_| false).await.unwrap();
        let (_, revision) = store.migration_with_revision("m1").await.unwrap().unwrap();
        assert_eq!(revision, 1);
        // A writer whose read went stale (another controller wrote in between) writes
        // nothing; update_migration then reads again.
        let (mut stale, revision) = store.migration_with_revision("m1").await.unwrap().unwrap();
        store
            .update_migration("m1", |m| {
                m.state = FleetMigrationState::Running;
                true
            })
            .await
            .unwrap();
        stale.state = FleetMigrationState::Failed;
        assert!(!store.write_migration(&stale, revision).await.unwrap());
        let m = store.migration("m1").await.unwrap().unwrap();
        assert_eq!(m.state, FleetMigrationState::Running);
        assert!(store.migration("m2").await.unwrap().is_none());
        assert_eq!(
            store
                .migrations_in(FleetMigrationState::Running, Some("a1"))
                .await
                .unwrap()
                .len(),
            1
        );
    }

    #[tokio::test]
    async fn one_leader_at_a_time_until_its_lease_runs_out() {
        let (_dir, store) = store().await;
        assert!(store.try_lead("c1", 1000, 500).await.unwrap());
        assert!(!store.try_lead("c2", 1200, 500).await.unwrap());
        assert!(store.try_lead("c1", 1400, 500).await.unwrap());
        assert_eq!(store.leader(1500).await.unwrap().as_deref(), Some("c1"));
        assert!(store.try_lead("c2", 2000, 500).await.unwrap());
        assert_eq!(store.leader(2100).await.unwrap().as_deref(), Some("c2"));
        store.resign("c2").await.unwrap();
        assert_eq!(store.leader(2100).await.unwrap(), None);
    }

    #[test]
    fn urls_lose_their_password_in_messages() {
        assert_eq!(
            redact("postgres://ferry:secret@db:5432/fleet"),
            "postgres://ferry:***@db:5432/fleet"
        );
        assert_eq!(redact("sqlite:///x.db"), "sqlite:///x.db");
    }
}
