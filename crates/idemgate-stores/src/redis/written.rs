//! What this replica last wrote for the keys it took (its `begin`, then each of its renewals),
//! so that `complete` and `renew` can replace that exact value with one
//! `SET key <new> IFEQ <written>` instead of their scripts.
//!
//! Why: the script cost Redis 10 to 12 µs per call on the benchmark machine (a Lua call with
//! these arguments is 3 µs before any work, and each `redis.call` inside adds 2 or more), five
//! times what `begin`'s `SET NX` costs. A compare-and-set on the whole value is the same
//! decision for the common case: the record is still exactly what this replica wrote, so it is in
//! flight, carries this attempt's token, and nobody waits on it (a waiter sets its flag, a
//! new owner everything). Whenever the value differs, or is gone, the
//! `SET` does nothing and the script decides as before, so every other case keeps one
//! implementation. `IFEQ` is in Valkey 8.1 and later (and Redis 8.4); an older server refuses
//! it as a syntax error once, and the store stops keeping values.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use idemgate_core::record::{LeaseToken, Millis};

/// At most this many values are kept (one per request in flight through this replica, until it
/// completes or releases; a renewal replaces it, or forgets it when the record has changed).
/// When full, a `begin` first drops the values of its shard whose lease has run out (an execution
/// abandoned without `complete` or `release`, which a library caller may do); if that frees
/// nothing it keeps nothing, and its `complete` takes the script.
const MAX_KEPT: usize = 65_536;
const SHARDS: usize = 16;

/// A value this replica wrote (its `begin` or its last renewal), and the record's logical expiry
/// and lease end in it.
#[derive(Clone, Debug)]
pub struct Kept {
    pub value: Vec<u8>,
    pub expires_at: Millis,
    pub lease_until: Millis,
}

/// The values, by lease token (random per attempt, so one token names one key's attempt).
#[derive(Debug)]
pub struct Written {
    shards: [Mutex<HashMap<u128, Kept>>; SHARDS],
    kept: AtomicUsize,
    /// The server refused `IFEQ`.
    refused: AtomicBool,
}

impl Default for Written {
    fn default() -> Self {
        Self {
            shards: std::array::from_fn(|_| Mutex::default()),
            kept: AtomicUsize::new(0),
            refused: AtomicBool::new(false),
        }
    }
}

impl Written {
    fn shard(&self, token: LeaseToken) -> &Mutex<HashMap<u128, Kept>> {
        // The token is random: its low bits spread the shards evenly.
        #[allow(clippy::cast_possible_truncation)]
        &self.shards[(token.0 as usize) % SHARDS]
    }

    /// Keeps what `begin` wrote for `token` at `now`, unless the server is known to refuse
    /// `IFEQ` or too many are kept already.
    pub fn keep(&self, token: LeaseToken, kept: Kept, now: Millis) {
        if self.refused() {
            return;
        }
        let mut shard = self.shard(token).lock().unwrap_or_else(PoisonError::into_inner);
        if self.kept.load(Ordering::Relaxed) >= MAX_KEPT {
            let before = shard.len();
            shard.retain(|_, k| k.lease_until > now);
            self.kept.fetch_sub(before - shard.len(), Ordering::Relaxed);
            if self.kept.load(Ordering::Relaxed) >= MAX_KEPT {
                return;
            }
        }
        if shard.insert(token.0, kept).is_none() {
            self.kept.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Takes the value kept for `token`: for `complete`, or to forget it when the record changes
    /// through this replica (a release).
    pub fn take(&self, token: LeaseToken) -> Option<Kept> {
        let kept = self
            .shard(token)
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&token.0);
        if kept.is_some() {
            self.kept.fetch_sub(1, Ordering::Relaxed);
        }
        kept
    }

    /// A copy of the value kept for `token`, left in place: for `renew`, which may be overtaken
    /// by this attempt's `complete` or `release` while its `SET` is under way (see
    /// [`Written::replace`]).
    pub fn peek(&self, token: LeaseToken) -> Option<Kept> {
        self.shard(token)
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&token.0)
            .cloned()
    }

    /// Replaces the value kept for `token` with `new` (or forgets it, `None`), but only if it
    /// is still `old`: a `complete` or `release` that took it meanwhile leaves nothing to
    /// replace, so nothing stays behind for a finished attempt.
    pub fn replace(&self, token: LeaseToken, old: &[u8], new: Option<Kept>) {
        let mut shard = self.shard(token).lock().unwrap_or_else(PoisonError::into_inner);
        let Some(kept) = shard.get_mut(&token.0) else {
            return;
        };
        if kept.value != old {
            return;
        }
        match new {
            Some(new) => *kept = new,
            None => {
                shard.remove(&token.0);
                self.kept.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Whether the server refused `IFEQ`.
    pub fn refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// The server refused `IFEQ`: keep nothing from now on.
    pub fn refuse(&self) {
        self.refused.store(true, Ordering::Relaxed);
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            self.kept.fetch_sub(shard.len(), Ordering::Relaxed);
            shard.clear();
        }
    }

    /// How many values are kept now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.kept.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(n: u8) -> Kept {
        Kept {
            value: vec![n],
            expires_at: 100,
            lease_until: 50,
        }
    }

    #[test]
    fn a_value_is_taken_once() {
        let w = Written::default();
        w.keep(LeaseToken(7), kept(1), 10);
        w.keep(LeaseToken(23), kept(2), 10);
        assert_eq!(w.len(), 2);
        assert_eq!(w.take(LeaseToken(7)).unwrap().value, [1]);
        assert!(w.take(LeaseToken(7)).is_none());
        assert_eq!(w.len(), 1);
    }

    /// A renewal replaces the value it compared, or forgets it, only while that value is still
    /// kept: not once a `complete` took it, nor when something else replaced it.
    #[test]
    fn a_renewal_replaces_only_the_value_it_compared() {
        let w = Written::default();
        let t = LeaseToken(7);
        w.keep(t, kept(1), 10);
        assert_eq!(w.peek(t).unwrap().value, [1], "a peek leaves it");
        w.replace(t, &[9], Some(kept(2)));
        assert_eq!(w.peek(t).unwrap().value, [1], "another value: left alone");
        w.replace(t, &[1], Some(kept(2)));
        assert_eq!(w.peek(t).unwrap().value, [2]);
        assert_eq!(w.len(), 1);
        w.replace(t, &[2], None);
        assert!(w.peek(t).is_none());
        assert_eq!(w.len(), 0);

        // Taken by a `complete` while the renewal's SET was under way: nothing comes back.
        w.keep(t, kept(3), 10);
        let compared = w.peek(t).unwrap().value;
        assert_eq!(w.take(t).unwrap().value, [3]);
        w.replace(t, &compared, Some(kept(4)));
        assert!(w.peek(t).is_none());
        assert_eq!(w.len(), 0);
    }

    #[test]
    fn a_refusing_server_stops_the_keeping() {
        let w = Written::default();
        w.keep(LeaseToken(7), kept(1), 10);
        w.refuse();
        assert_eq!(w.len(), 0);
        w.keep(LeaseToken(8), kept(2), 10);
        assert!(w.take(LeaseToken(8)).is_none());
    }

    #[test]
    fn keeping_is_bounded_and_a_full_map_drops_lapsed_leases() {
        let w = Written::default();
        for t in 0..(MAX_KEPT as u128 + 10) {
            w.keep(LeaseToken(t), kept(0), 10);
        }
        assert_eq!(w.len(), MAX_KEPT);
        assert!(w.take(LeaseToken(MAX_KEPT as u128 + 5)).is_none());
        // Past every kept lease (50): the next keep clears its shard of them and is kept.
        let late = MAX_KEPT as u128 + 20;
        w.keep(LeaseToken(late), kept(1), 60);
        assert_eq!(w.take(LeaseToken(late)).unwrap().value, [1]);
        assert!(w.len() < MAX_KEPT - MAX_KEPT / SHARDS / 2, "{}", w.len());
        assert!(
            w.take(LeaseToken(4)).is_none(),
            "a lapsed value in that shard is gone"
        );
    }
}
