//! Simulated regions on loopback: a `redis-server` a region, and between every two a
//! [`LatencyProxy`] a direction, so that the distance can be set and one region cut off
//! from the others in both directions.

use std::time::Duration;

use crate::RedisServer;
use crate::proxy::LatencyProxy;

/// `n` regions, each with its own Redis; region `i` reaches region `j`'s through a
/// proxy of its own. Stops everything on drop.
#[derive(Debug)]
pub struct Regions {
    servers: Vec<RedisServer>,
    /// `links[i][j]`: region `i`'s way to region `j`'s Redis (none to its own).
    links: Vec<Vec<Option<LatencyProxy>>>,
}

impl Regions {
    /// Starts `n` regions `one_way` apart.
    pub async fn start(n: usize, one_way: Duration) -> Self {
        let servers: Vec<RedisServer> = (0..n).map(|_| RedisServer::start()).collect();
        let mut links = Vec::new();
        for i in 0..n {
            let mut row = Vec::new();
            for (j, server) in servers.iter().enumerate() {
                let target = format!("127.0.0.1:{}", server.port()).parse().unwrap();
                row.push(if i == j {
                    None
                } else {
                    Some(LatencyProxy::start(target, one_way).await)
                });
            }
            links.push(row);
        }
        Regions { servers, links }
    }

    /// How many regions there are.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// The URL by which region `from` reaches region `to`'s Redis: its own directly,
    /// another's through the proxy between them.
    pub fn url(&self, from: usize, to: usize) -> String {
        match &self.links[from][to] {
            Some(link) => link.redis_url(),
            None => self.servers[to].url(),
        }
    }

    /// Every link's delay each way from now on.
    pub fn set_one_way(&self, one_way: Duration) {
        for link in self.links.iter().flatten().flatten() {
            link.set_one_way(one_way);
        }
    }

    /// Cuts (or heals) every link to and from region `r`.
    pub fn isolate(&self, r: usize, cut: bool) {
        for (i, row) in self.links.iter().enumerate() {
            for (j, link) in row.iter().enumerate() {
                if let Some(link) = link.as_ref().filter(|_| i == r || j == r) {
                    if cut { link.cut() } else { link.heal() }
                }
            }
        }
    }
}
