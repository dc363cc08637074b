//! Turns to read a proxy's `/-/routes`, bounded in all and shared fairly between clusters.
//!
//! A read holds its body and the table parsed from it until the prober's manager has kept
//! or refused the table, so the reads in flight are bounded ([`RouteTurns::new`]'s
//! `total`, `prober::ROUTE_READS_AT_ONCE`). Without more, one cluster whose thousand
//! proxies answer slowly (or stall mid-body) would hold every turn and starve another
//! cluster's reads: so each cluster may hold at most its share, `total / clusters` (at
//! least one). While there are no more clusters than turns the shares add up to at most
//! `total`, so a cluster within its share never waits for another's reads; past that,
//! each holds at most one and they queue for the rest.
//!
//! Invariants: a cluster holds at most its share of turns (counted when the share is
//! taken; a share that shrinks as clusters arrive is not taken back from reads in
//! flight); a turn's count and permit come back when it is dropped, however the read
//! ended.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The route-read turns of every proxy the prober follows.
#[derive(Debug)]
pub(crate) struct RouteTurns {
    total: usize,
    permits: Arc<Semaphore>,
    book: Mutex<Book>,
}

#[derive(Debug, Default)]
struct Book {
    /// Proxy → the cluster whose share its reads take (its Envoy cluster name).
    owners: HashMap<SocketAddr, Arc<str>>,
    /// Cluster → turns it holds now.
    held: HashMap<Arc<str>, usize>,
    /// Clusters with at least one proxy.
    clusters: usize,
}

/// One read's turn: held until the table it read is kept or refused.
#[derive(Debug)]
pub(crate) struct RouteTurn {
    _permit: OwnedSemaphorePermit,
    _share: Share,
}

/// A cluster's count of one turn, given back on drop.
#[derive(Debug)]
struct Share {
    turns: Arc<RouteTurns>,
    cluster: Arc<str>,
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut book = self.turns.book.lock().expect("never poisoned");
        if let Some(n) = book.held.get_mut(&self.cluster) {
            *n -= 1;
            if *n == 0 {
                book.held.remove(&self.cluster);
            }
        }
    }
}

impl RouteTurns {
    /// `total` turns in all (at least one).
    pub fn new(total: usize) -> Arc<RouteTurns> {
        let total = total.max(1);
        Arc::new(RouteTurns {
            total,
            permits: Arc::new(Semaphore::new(total)),
            book: Mutex::new(Book::default()),
        })
    }

    /// Which cluster each proxy belongs to (the prober's model), replacing the last.
    pub(crate) fn set_owners(&self, owners: &BTreeMap<SocketAddr, String>) {
        let mut names: HashMap<&str, Arc<str>> = HashMap::new();
        let owners: HashMap<SocketAddr, Arc<str>> = owners
            .iter()
            .map(|(address, cluster)| {
                let name = names
                    .entry(cluster.as_str())
                    .or_insert_with(|| Arc::from(cluster.as_str()))
                    .clone();
                (*address, name)
            })
            .collect();
        let mut book = self.book.lock().expect("never poisoned");
        book.clusters = names.len();
        book.owners = owners;
    }

    #[cfg(test)]
    /// What one cluster may hold at once now.
    pub(crate) fn share(&self) -> usize {
        let clusters = self.book.lock().expect("never poisoned").clusters;
        self.share_among(clusters)
    }

    /// A cluster's share of the turns among `clusters`: at least one.
    fn share_among(&self, clusters: usize) -> usize {
        (self.total / clusters.max(1)).max(1)
    }

    /// A turn for `address`'s next read: `None` at once when its cluster holds its share
    /// (or the proxy belongs to none), or when no turn frees within `wait`.
    pub(crate) async fn take(
        self: &Arc<Self>,
        address: SocketAddr,
        wait: Duration,
    ) -> Option<RouteTurn> {
        let share = {
            let mut book = self.book.lock().expect("never poisoned");
            let cluster = book.owners.get(&address)?.clone();
            let share = self.share_among(book.clusters);
            let held = book.held.entry(cluster.clone()).or_insert(0);
            if *held >= share {
                return None;
            }
            *held += 1;
            Share {
                turns: self.clone(),
                cluster,
            }
        };
        // On a timeout `share` drops here and gives its count back.
        let permit = tokio::time::timeout(wait, self.permits.clone().acquire_owned())
            .await
            .ok()?
            .ok()?;
        Some(RouteTurn {
            _permit: permit,
            _share: share,
        })
    }

    #[cfg(test)]
    /// Turns free now, over all clusters.
    pub(crate) fn available(&self) -> usize {
        self.permits.available_permits()
    }

    #[cfg(test)]
    /// Turns `cluster` holds now.
    pub(crate) fn held_by(&self, cluster: &str) -> usize {
        let book = self.book.lock().expect("never poisoned");
        book.held.get(cluster).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn owners(clusters: &[(&str, std::ops::Range<u16>)]) -> BTreeMap<SocketAddr, String> {
        clusters
            .iter()
            .flat_map(|(c, ports)| ports.clone().map(move |p| (address(p), c.to_string())))
            .collect()
    }

    const NOW: Duration = Duration::ZERO;

    /// A thousand proxies of one cluster reading slowly hold
    /// at most its share, and another cluster's read gets a turn at once.
    #[tokio::test]
    async fn a_cluster_with_many_proxies_cannot_hold_every_turn() {
        let turns = RouteTurns::new(16);
        turns.set_owners(&owners(&[("hog", 1..1001), ("mine", 2000..2003)]));
        assert_eq!(turns.share(), 8);
        let mut hog = Vec::new();
        for port in 1..1001 {
            if let Some(t) = turns.take(address(port), NOW).await {
                hog.push(t);
            }
        }
        assert_eq!(hog.len(), 8);
        assert_eq!(turns.held_by("hog"), 8);
        let mine: Vec<_> = [2000, 2001, 2002]
            .into_iter()
            .map(address)
            .collect::<Vec<_>>();
        let mut kept = Vec::new();
        for a in mine {
            kept.push(turns.take(a, NOW).await.expect("mine is within its share"));
        }
        assert_eq!(turns.held_by("mine"), 3);
        assert_eq!(turns.available(), 16 - 8 - 3);
        // A read that ends gives its turn back to its cluster.
        hog.pop();
        assert_eq!(turns.held_by("hog"), 7);
        assert!(turns.take(address(500), NOW).await.is_some());
        drop(kept);
        assert_eq!(turns.held_by("mine"), 0);
    }

    /// Shares follow the number of clusters; a proxy of no cluster gets no turn.
    #[tokio::test]
    async fn shares_follow_the_clusters() {
        let turns = RouteTurns::new(16);
        assert!(turns.take(address(1), NOW).await.is_none());
        turns.set_owners(&owners(&[("a", 1..100)]));
        assert_eq!(turns.share(), 16);
        turns.set_owners(&owners(&[("a", 1..100), ("b", 100..200), ("c", 200..300)]));
        assert_eq!(turns.share(), 5);
        let mut held = Vec::new();
        for port in 1..300 {
            if let Some(t) = turns.take(address(port), NOW).await {
                held.push(t);
            }
        }
        assert_eq!(held.len(), 15);
        for c in ["a", "b", "c"] {
            assert_eq!(turns.held_by(c), 5);
        }
        drop(held);
        assert_eq!(turns.available(), 16);
        assert_eq!(turns.held_by("a"), 0);
    }

    /// More clusters than turns: each may hold one, and the rest wait for a turn to
    /// free (and give up at the deadline, their count given back).
    #[tokio::test]
    async fn past_one_cluster_per_turn_each_holds_one_and_the_rest_wait() {
        let turns = RouteTurns::new(4);
        let clusters: Vec<(String, std::ops::Range<u16>)> = (0..6)
            .map(|i| (format!("c{i}"), (i * 10 + 1)..(i * 10 + 3)))
            .collect();
        let named: Vec<(&str, std::ops::Range<u16>)> = clusters
            .iter()
            .map(|(c, r)| (c.as_str(), r.clone()))
            .collect();
        turns.set_owners(&owners(&named));
        assert_eq!(turns.share(), 1);
        let mut held = Vec::new();
        for i in 0..4u16 {
            held.push(turns.take(address(i * 10 + 1), NOW).await.unwrap());
        }
        // c0's second proxy: over c0's share.
        assert!(turns
            .take(address(2), Duration::from_secs(5))
            .await
            .is_none());
        // c4: within its share, but every turn is held: it waits, then gives up.
        assert!(turns
            .take(address(41), Duration::from_millis(20))
            .await
            .is_none());
        assert_eq!(turns.held_by("c4"), 0);
        // One frees: c4 gets it.
        let waiting = {
            let turns = turns.clone();
            tokio::spawn(async move { turns.take(address(41), Duration::from_secs(30)).await })
        };
        tokio::task::yield_now().await;
        held.remove(0);
        assert!(waiting.await.unwrap().is_some());
    }
}
