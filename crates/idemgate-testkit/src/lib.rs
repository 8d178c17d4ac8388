//! Test support shared by the workspace's integration tests: what more than one test crate
//! needs, kept once (each crate's own `tests/common` or `tests/support` holds the rest).

mod redis_server;

pub use redis_server::RedisServer;
