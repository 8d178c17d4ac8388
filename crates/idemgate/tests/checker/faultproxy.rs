//! A fault-injecting TCP proxy for the checker, between a gateway and its store (toxiproxy is
//! not available here). Each gateway gets its own proxy, so a fault can cut one replica off
//! while the other still reaches the store (a partition), or both at once.
//!
//! Faults, switched at any time and applied to open and new connections alike:
//! - `Delay(d)`: every chunk, in either direction, waits `d` before it is forwarded;
//! - `Drop`: open connections are closed (FIN) and new ones are accepted and closed at once,
//!   like a store process that went away;
//! - `Reset`: the same with RST (zero linger), like a crashed host or a firewall's reject;
//! - `Blackhole`: nothing is read or forwarded until the fault is lifted, then the bytes flow
//!   again (a partition that heals before TCP gives up: the peer only sees silence).
//! - `SlowConnect(d)`: a new connection waits `d` before it reaches the target; open ones pass
//!   (a server slow to accept, such as a PostgreSQL busy forking backends).

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    Pass,
    Delay(Duration),
    Drop,
    Reset,
    Blackhole,
    SlowConnect(Duration),
}

impl Fault {
    /// Faults that end a connection.
    fn kills(self) -> bool {
        matches!(self, Self::Drop | Self::Reset)
    }
}

pub struct FaultProxy {
    pub port: u16,
    mode: watch::Sender<Fault>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (mode, rx) = watch::channel(Fault::Pass);
        let task = tokio::spawn(async move {
            // Connections live in the set, so dropping the proxy closes every one of them.
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                let _ = inbound.set_nodelay(true);
                let rx = rx.clone();
                conns.spawn(connection(inbound, target, rx));
                // Reap finished connections so a long run does not accumulate them.
                while conns.try_join_next().is_some() {}
            }
        });
        Self { port, mode, task }
    }

    pub fn set(&self, fault: Fault) {
        self.mode.send_replace(fault);
    }

    pub fn fault(&self) -> Fault {
        *self.mode.borrow()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Ends `stream` as the fault says: RST for `Reset`, FIN otherwise.
fn close(stream: &TcpStream, fault: Fault) {
    if fault == Fault::Reset {
        let _ = stream.set_zero_linger();
    }
}

/// Waits while the fault is `Blackhole`; returns the fault that ended the wait.
async fn through_blackhole(rx: &mut watch::Receiver<Fault>) -> Fault {
    loop {
        let now = *rx.borrow_and_update();
        if now != Fault::Blackhole {
            return now;
        }
        if rx.changed().await.is_err() {
            return Fault::Drop;
        }
    }
}

async fn connection(mut inbound: TcpStream, target: SocketAddr, mut rx: watch::Receiver<Fault>) {
    // A new connection meets the current fault before anything is forwarded.
    let fault = through_blackhole(&mut rx).await;
    if fault.kills() {
        close(&inbound, fault);
        return;
    }
    if let Fault::SlowConnect(d) = fault {
        tokio::time::sleep(d).await;
    }
    let Ok(mut outbound) = TcpStream::connect(target).await else {
        return;
    };
    let _ = outbound.set_nodelay(true);
    let (mut a, mut b) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        let fault = through_blackhole(&mut rx).await;
        if fault.kills() {
            close(&inbound, fault);
            close(&outbound, fault);
            return;
        }
        // One direction at a time is enough for a store protocol (request, then reply), and it
        // keeps the fault checks in one place.
        let (chunk, to_outbound) = tokio::select! {
            r = inbound.read(&mut a) => match r {
                Ok(n) if n > 0 => (n, true),
                _ => return,
            },
            r = outbound.read(&mut b) => match r {
                Ok(n) if n > 0 => (n, false),
                _ => return,
            },
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
        };
        // The chunk is read: a fault that arrives now applies to it (held by a blackhole,
        // delayed, or lost with the connection).
        let mut fault = through_blackhole(&mut rx).await;
        if let Fault::Delay(d) = fault {
            tokio::time::sleep(d).await;
            fault = through_blackhole(&mut rx).await;
        }
        if fault.kills() {
            close(&inbound, fault);
            close(&outbound, fault);
            return;
        }
        let written = if to_outbound {
            outbound.write_all(&a[..chunk]).await
        } else {
            inbound.write_all(&b[..chunk]).await
        };
        if written.is_err() {
            return;
        }
    }
}
