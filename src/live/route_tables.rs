//! The route tables (`GET /-/routes`) the prober keeps, shared and budgeted.
//!
//! Every proxy of a cluster normally lists the same routes, so a table is kept once per
//! cluster and shared (`Arc`) by every proxy that lists it, and by every publication of
//! the probe states (which are cloned per publication). What the tables of all clusters
//! hold is bounded by [`MEMORY_BUDGET_BYTES`], shared fairly between clusters
//! (`budget::FairBudget`): a proxy whose new table would take its cluster over its fair
//! share of a full budget gets no table (its routes are unknown, as for a malformed
//! answer), and a cluster within its share always gets in, evicting the tables of
//! clusters over theirs (their proxies' routes become unknown until read again).
//!
//! Invariants: a cluster's held bytes are the sum of its distinct tables' sizes; a table
//! nobody refers to any more is forgotten at the next [`RouteTables::collect`].

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

use crate::budget::{FairBudget, OverBudget};

/// What the route tables of all clusters may hold in all (estimated by [`table_bytes`]):
/// 32 MiB, over 100 tables at the caps (`prober::MAX_ROUTES_BODY_BYTES` of routes).
pub const MEMORY_BUDGET_BYTES: usize = crate::config::ROUTE_TABLES_BUDGET_BYTES;

/// One proxy's route prefixes.
pub(crate) type Table = Arc<BTreeSet<String>>;

/// About what a table costs in memory: its strings, their headers and the set's nodes.
pub(crate) fn table_bytes(table: &BTreeSet<String>) -> usize {
    table.iter().map(|r| r.len() + 48).sum::<usize>() + 64
}

/// Every cluster's distinct tables and the budget over them.
#[derive(Debug)]
pub(crate) struct RouteTables {
    tables: BTreeMap<String, HashSet<Table>>,
    budget: FairBudget<String>,
}

impl RouteTables {
    pub fn new(budget: usize) -> Self {
        RouteTables {
            tables: BTreeMap::new(),
            budget: FairBudget::new(budget),
        }
    }

    /// The shared table equal to `table` for a proxy of `cluster`: one already kept, or
    /// `table` itself when the budget admits it. `Ok` also names the clusters evicted to
    /// make room: the caller must drop their proxies' tables (and call
    /// [`collect`](Self::collect)).
    pub(crate) fn intern(
        &mut self,
        cluster: &str,
        table: BTreeSet<String>,
    ) -> Result<(Table, Vec<String>), OverBudget> {
        let kept = self.tables.entry(cluster.to_string()).or_default();
        if let Some(shared) = kept.get(&table) {
            return Ok((shared.clone(), Vec::new()));
        }
        let size = table_bytes(&table);
        // What the budget records for the cluster is the sum of its kept tables (set
        // here on admission, recounted by `collect`): no need to re-measure them.
        let held = self.budget.held_by(&cluster.to_string());
        let evicted = self.budget.admit(&cluster.to_string(), held + size)?;
        for hog in &evicted {
            self.tables.remove(hog);
        }
        let shared = Arc::new(table);
        self.tables
            .entry(cluster.to_string())
            .or_default()
            .insert(shared.clone());
        Ok((shared, evicted))
    }

    /// Forgets every table no proxy refers to any more (only this book holds it), and
    /// clusters not in `clusters`; each cluster's holding is recounted.
    pub(crate) fn collect<'a>(&mut self, clusters: impl IntoIterator<Item = &'a str>) {
        let alive: BTreeSet<&str> = clusters.into_iter().collect();
        self.tables.retain(|c, _| alive.contains(c.as_str()));
        self.budget.retain(|c| alive.contains(c.as_str()));
        for (cluster, kept) in self.tables.iter_mut() {
            kept.retain(|t| Arc::strong_count(t) > 1);
            let held = kept.iter().map(|t| table_bytes(t)).sum();
            // Shrinking (or keeping) a holding is always admitted.
            let _ = self.budget.admit(cluster, held);
        }
    }

    /// What all tables hold, as the budget counts it.
    pub(crate) fn total_bytes(&self) -> usize {
        self.budget.total()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(prefix: &str, n: usize) -> BTreeSet<String> {
        (0..n).map(|i| format!("/{prefix}{i}")).collect()
    }

    #[test]
    fn equal_tables_of_a_cluster_are_kept_once() {
        let mut book = RouteTables::new(1 << 20);
        let (a, _) = book.intern("c", table("app", 10)).unwrap();
        let (b, _) = book.intern("c", table("app", 10)).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(book.total_bytes(), table_bytes(&a));
        // Dropped by every proxy: forgotten at the next collection.
        drop((a, b));
        book.collect(["c"]);
        assert_eq!(book.total_bytes(), 0);
    }

    #[test]
    fn a_cluster_within_its_share_evicts_one_over_it() {
        let small = table_bytes(&table("x", 2));
        let big = table_bytes(&table("big", 50));
        let mut book = RouteTables::new(big + small - 1);
        let (hog, evicted) = book.intern("hog", table("big", 50)).unwrap();
        assert!(evicted.is_empty());
        let (_mine, evicted) = book.intern("mine", table("x", 2)).unwrap();
        assert_eq!(evicted, vec!["hog".to_string()]);
        drop(hog);
        book.collect(["hog", "mine"]);
        assert_eq!(book.total_bytes(), small);
        // The hog's next table is over its share of a full budget: refused.
        assert!(book.intern("hog", table("big", 50)).is_err());
        assert_eq!(book.total_bytes(), small);
        // A cluster gone gives its bytes back.
        book.collect(["hog"]);
        assert_eq!(book.total_bytes(), 0);
    }
}
