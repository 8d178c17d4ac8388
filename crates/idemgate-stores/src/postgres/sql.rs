//! The PostgreSQL store's schema (versioned migrations) and statements.
//!
//! The table lives in the first schema of the connection's `search_path`, so several
//! independent stores can share one database (`?options=-c%20search_path%3Dmy_schema` in the
//! URL).

/// Serializes migrations between replicas that start at the same moment
/// (`pg_advisory_xact_lock`; the number spells "idemgate" in ASCII).
pub const MIGRATION_LOCK: i64 = 0x6964_656d_6761_7465;

/// The migrations, in order. A version is applied once and never edited afterwards; a change
/// is a new version.
pub const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        r#"
CREATE TABLE idemgate_records (
    key          text COLLATE "C" PRIMARY KEY,
    state        smallint NOT NULL,          -- 0 in flight, 1 completed
    token        bytea    NOT NULL,          -- the owner's 128-bit lease token
    lease_until  bigint,                     -- in flight only; ms since the Unix epoch
    fingerprint  bytea    NOT NULL,          -- SHA-256 of the request
    route        text     NOT NULL,
    operation_id text     NOT NULL,
    created_at   bigint   NOT NULL,
    expires_at   bigint   NOT NULL,          -- 9223372036854775807: never
    generation   bigint   NOT NULL,
    waiters      boolean  NOT NULL DEFAULT false,  -- someone waits: complete/release NOTIFY
    response     bytea,                      -- completed only; see idemgate_stores::codec
    -- The tenant component of the namespaced key `t-{tenant}:{project}:{subject}:{raw}`, as
    -- written in the key (percent-escaped), for row-level security.
    tenant       text GENERATED ALWAYS AS (substring(key from '^t-([^:]*):')) STORED
);
CREATE INDEX idemgate_records_expires_at ON idemgate_records (expires_at);
"#,
    ),
    (
        2,
        r"
-- Row-level security, off until an operator enables it (docs/stores.md): a role that is not
-- the table's owner then sees and writes only the rows of the tenant named by its session
-- setting `idemgate.tenant`.
CREATE POLICY idemgate_tenant_isolation ON idemgate_records
    USING (tenant = current_setting('idemgate.tenant', true))
    WITH CHECK (tenant = current_setting('idemgate.tenant', true));
",
    ),
];

pub const CREATE_MIGRATIONS: &str = "CREATE TABLE IF NOT EXISTS idemgate_migrations (
    version    integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
)";

/// The record columns, in the order [`super::row::record`] reads them.
macro_rules! columns {
    () => {
        "state, token, lease_until, fingerprint, route, operation_id, created_at, expires_at, generation, waiters, response"
    };
}

/// Begin's common path in one round trip: try to insert a first owner's record and, in the
/// same statement, read the existing one if there is a conflict. `inserted` is 1 when the
/// insert won. A conflict with a row committed after the statement's snapshot reads no row;
/// the caller then takes the locked path.
pub const BEGIN: &str = concat!(
    "WITH ins AS (
    INSERT INTO idemgate_records
        (key, state, token, lease_until, fingerprint, route, operation_id, created_at, expires_at, generation)
    VALUES ($1, 0, $2, $3, $4, $5, $6, $7, $8, 1)
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM ins) AS inserted, ",
    columns!(),
    "
FROM (SELECT 1) AS one LEFT JOIN idemgate_records ON key = $1"
);

/// Marks the in-flight record of `token` as waited on; no row means it changed meanwhile.
pub const FLAG_WAITERS: &str =
    "UPDATE idemgate_records SET waiters = true WHERE key = $1 AND token = $2 AND state = 0";

/// Complete's common path: exactly the write `rules::complete` makes, guarded by exactly its
/// condition (live, in flight, owned by the token), plus a notification if someone waits.
/// No row updated: the locked path decides (a retry after it took effect, or fenced).
pub const COMPLETE: &str = "WITH u AS (
    UPDATE idemgate_records SET state = 1, response = $3, expires_at = $4, lease_until = NULL
    WHERE key = $1 AND token = $2 AND state = 0 AND expires_at > $5
    RETURNING waiters
)
SELECT (SELECT count(*) FROM u), (SELECT count(*) FROM (SELECT pg_notify($6, $1) FROM u WHERE waiters) n)";

/// Release's common path: the owner's in-flight record is deleted.
pub const RELEASE: &str = "WITH d AS (
    DELETE FROM idemgate_records WHERE key = $1 AND token = $2 AND state = 0
    RETURNING waiters
)
SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM (SELECT pg_notify($3, $1) FROM d WHERE waiters) n)";

/// `rules::renew` in full: no row means the token does not own an in-flight record (fenced).
pub const RENEW: &str = "UPDATE idemgate_records SET lease_until = GREATEST(lease_until, $3), expires_at = GREATEST(expires_at, $3)
    WHERE key = $1 AND token = $2 AND state = 0";

pub const GET: &str = concat!("SELECT ", columns!(), " FROM idemgate_records WHERE key = $1");

pub const LOCK: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM idemgate_records WHERE key = $1 FOR UPDATE"
);

pub const INSERT: &str = "INSERT INTO idemgate_records
    (key, state, token, lease_until, fingerprint, route, operation_id, created_at, expires_at, generation, waiters, response)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, false, $11)
    ON CONFLICT (key) DO NOTHING";

pub const UPDATE: &str = "UPDATE idemgate_records SET state = $2, token = $3, lease_until = $4, fingerprint = $5,
    route = $6, operation_id = $7, created_at = $8, expires_at = $9, generation = $10, waiters = $11, response = $12
    WHERE key = $1";

pub const DELETE: &str = "DELETE FROM idemgate_records WHERE key = $1";

pub const NOTIFY: &str = "SELECT pg_notify($2, $1)";

pub const PURGE: &str = "WITH d AS (DELETE FROM idemgate_records WHERE key = $1 RETURNING 1)
SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM (SELECT pg_notify($2, $1)) n)";

/// Deletes up to `$2` records expired at `$1`, skipping rows a request holds, so a sweep never
/// waits behind traffic and replicas sweeping at once do not collide.
pub const SWEEP: &str = "DELETE FROM idemgate_records WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM idemgate_records WHERE expires_at <= $1 LIMIT $2 FOR UPDATE SKIP LOCKED
)) AND expires_at <= $1";
