//! A record as a table row: reading one, and the parameters that write one.
//!
//! Milliseconds are `bigint`; `Millis::MAX` (a record that never expires) is stored as
//! `i64::MAX` and read back as `Millis::MAX`.

use idemgate_core::record::{Millis, Record, RecordState};
use idemgate_core::store::StoreError;
use tokio_postgres::types::ToSql;

use crate::codec::{corrupt, decode_response, encode_response, fingerprint_from, token_bytes, token_from};

/// A stored row: the record and whether someone waits on it.
#[derive(Clone, Debug)]
pub struct Row {
    pub record: Record,
    pub waiters: bool,
}

/// Milliseconds as a `bigint`, saturating (`Millis::MAX` means never).
#[must_use]
pub fn db_ms(ms: Millis) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

fn from_db_ms(ms: i64) -> Millis {
    if ms == i64::MAX {
        Millis::MAX
    } else {
        u64::try_from(ms).unwrap_or(0)
    }
}

impl Row {
    /// Reads the record columns (see `sql::columns!`) starting at column 0.
    pub fn read(row: &tokio_postgres::Row) -> Result<Self, StoreError> {
        Self::read_at(row, 0)?.ok_or_else(|| corrupt("empty record row"))
    }

    /// Reads the record columns starting at column `at`; `None` when they are NULL (an outer
    /// join that found no record).
    pub fn read_at(row: &tokio_postgres::Row, at: usize) -> Result<Option<Self>, StoreError> {
        let get_err = |e| StoreError::Corrupt(Box::new(e));
        let Some(state) = row.try_get::<_, Option<i16>>(at).map_err(get_err)? else {
            return Ok(None);
        };
        let token = token_from(row.try_get::<_, &[u8]>(at + 1).map_err(get_err)?)?;
        let state = match state {
            0 => RecordState::InFlight {
                token,
                lease_until: from_db_ms(
                    row.try_get::<_, Option<i64>>(at + 2)
                        .map_err(get_err)?
                        .ok_or_else(|| corrupt("in-flight record without a lease"))?,
                ),
            },
            1 => RecordState::Completed {
                token,
                response: decode_response(
                    row.try_get::<_, Option<&[u8]>>(at + 10)
                        .map_err(get_err)?
                        .ok_or_else(|| corrupt("completed record without a response"))?,
                )?,
            },
            _ => return Err(corrupt("unknown record state")),
        };
        let record = Record {
            state,
            fingerprint: fingerprint_from(row.try_get::<_, &[u8]>(at + 3).map_err(get_err)?)?,
            route: row.try_get(at + 4).map_err(get_err)?,
            operation_id: row.try_get(at + 5).map_err(get_err)?,
            created_at: from_db_ms(row.try_get(at + 6).map_err(get_err)?),
            expires_at: from_db_ms(row.try_get(at + 7).map_err(get_err)?),
            generation: u64::try_from(row.try_get::<_, i64>(at + 8).map_err(get_err)?).unwrap_or(0),
        };
        Ok(Some(Self {
            record,
            waiters: row.try_get(at + 9).map_err(get_err)?,
        }))
    }
}

/// The lease column of a record.
#[must_use]
pub fn lease_of(rec: &Record) -> Option<i64> {
    match rec.state {
        RecordState::InFlight { lease_until, .. } => Some(db_ms(lease_until)),
        RecordState::Completed { .. } => None,
    }
}

/// Owned values of every column, borrowed as statement parameters.
pub struct Params {
    key: String,
    state: i16,
    token: Vec<u8>,
    lease_until: Option<i64>,
    fingerprint: Vec<u8>,
    route: String,
    operation_id: String,
    created_at: i64,
    expires_at: i64,
    generation: i64,
    waiters: Option<bool>,
    response: Option<Vec<u8>>,
}

impl Params {
    fn new(key: &str, rec: &Record, waiters: Option<bool>) -> Self {
        let (state, response) = match &rec.state {
            RecordState::InFlight { .. } => (0, None),
            RecordState::Completed { response, .. } => (1, Some(encode_response(response))),
        };
        Self {
            key: key.to_owned(),
            state,
            token: token_bytes(rec.token()).to_vec(),
            lease_until: lease_of(rec),
            fingerprint: rec.fingerprint.0.to_vec(),
            route: rec.route.clone(),
            operation_id: rec.operation_id.clone(),
            created_at: db_ms(rec.created_at),
            expires_at: db_ms(rec.expires_at),
            generation: i64::try_from(rec.generation).unwrap_or(i64::MAX),
            waiters,
            response,
        }
    }

    /// The parameters in `sql::INSERT` / `sql::UPDATE` order.
    pub fn as_params(&self) -> Vec<&(dyn ToSql + Sync)> {
        let mut p: Vec<&(dyn ToSql + Sync)> = vec![
            &self.key,
            &self.state,
            &self.token,
            &self.lease_until,
            &self.fingerprint,
            &self.route,
            &self.operation_id,
            &self.created_at,
            &self.expires_at,
            &self.generation,
        ];
        if let Some(w) = &self.waiters {
            p.push(w);
        }
        p.push(&self.response);
        p
    }
}

/// Parameters of `sql::INSERT`.
#[must_use]
pub fn insert_params(key: &str, rec: &Record) -> Params {
    Params::new(key, rec, None)
}

/// Parameters of `sql::UPDATE`.
#[must_use]
pub fn update_params(key: &str, rec: &Record, waiters: bool) -> Params {
    Params::new(key, rec, Some(waiters))
}
