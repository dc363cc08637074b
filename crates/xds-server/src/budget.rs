//! A memory budget shared fairly between owners (Ray clusters): what outside answers
//! (dashboards, `/-/routes`) may cost ray-xds in all.
//!
//! Every cluster's dashboard and proxies answer with data ray-xds keeps; each answer is
//! capped on its own, but a tenant can create many RayServices, so the sum needs a bound
//! too, and that bound must not become a way for one tenant to starve another. An
//! owner's new holding (replacing its old one) is:
//!
//! - admitted when the total stays within the budget;
//! - else, when it is within the owner's fair share (the budget divided by the owners
//!   holding anything, this one included), admitted after **evicting** the largest
//!   holders over their fair share until the total fits (their callers drop what they
//!   held: the hogs lose their own data, not their neighbours);
//! - else refused, and nothing changes: the caller keeps the owner's last admitted state.
//!
//! So the total never exceeds the budget, and an owner within its fair share is always
//! admitted, however much others hold. Pure: sizes are whatever the caller estimates
//! (bytes of strings plus a per-entry overhead); no allocator is consulted.

use std::collections::BTreeMap;

/// Sizes held per owner against one budget.
#[derive(Debug, Clone)]
pub struct FairBudget<K: Ord> {
    budget: usize,
    held: BTreeMap<K, usize>,
    total: usize,
}

/// Why an owner's new holding was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverBudget {
    /// What the owner asked to hold.
    pub wanted: usize,
    /// Its fair share at the time.
    pub fair_share: usize,
    /// What all owners held, this one's current holding included.
    pub total: usize,
    pub budget: usize,
}

impl std::fmt::Display for OverBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} KiB would pass the memory budget ({} KiB held of {} KiB) and is over this cluster's fair share ({} KiB)",
            self.wanted.div_ceil(1024),
            self.total.div_ceil(1024),
            self.budget.div_ceil(1024),
            self.fair_share.div_ceil(1024)
        )
    }
}

impl<K: Ord + Clone> FairBudget<K> {
    pub fn new(budget: usize) -> Self {
        FairBudget {
            budget,
            held: BTreeMap::new(),
            total: 0,
        }
    }

    /// Replaces what `owner` holds with `size` if admitted (see the module doc); `Ok`
    /// names the owners evicted to make room, whose holdings are now zero.
    pub fn admit(&mut self, owner: &K, size: usize) -> Result<Vec<K>, OverBudget> {
        let old = self.held.get(owner).copied().unwrap_or(0);
        let others = self.total - old;
        let owners = self.held.len() + usize::from(!self.held.contains_key(owner));
        let fair_share = self.budget / owners.max(1);
        let mut evicted = Vec::new();
        if others.saturating_add(size) > self.budget {
            if size > fair_share {
                return Err(OverBudget {
                    wanted: size,
                    fair_share,
                    total: self.total,
                    budget: self.budget,
                });
            }
            // Largest first; only those over their fair share. When every other owner
            // is within it, others + size <= owners * fair_share <= budget, so this
            // always makes room.
            let mut hogs: Vec<(usize, K)> = self
                .held
                .iter()
                .filter(|(k, held)| *k != owner && **held > fair_share)
                .map(|(k, held)| (*held, k.clone()))
                .collect();
            hogs.sort_by_key(|(held, _)| std::cmp::Reverse(*held));
            for (_, hog) in hogs {
                if self.total - old + size <= self.budget {
                    break;
                }
                self.release(&hog);
                evicted.push(hog);
            }
        }
        self.total = self.total - old + size;
        if size == 0 {
            self.held.remove(owner);
        } else {
            self.held.insert(owner.clone(), size);
        }
        Ok(evicted)
    }

    /// Forgets `owner` (its cluster is gone, or its data was dropped).
    pub(crate) fn release(&mut self, owner: &K) {
        if let Some(old) = self.held.remove(owner) {
            self.total -= old;
        }
    }

    /// Keeps only the owners `keep` says yes to.
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        let total = &mut self.total;
        self.held.retain(|k, size| {
            let kept = keep(k);
            if !kept {
                *total -= *size;
            }
            kept
        });
    }

    /// What all owners hold.
    pub fn total(&self) -> usize {
        self.total
    }

    /// What `owner` holds.
    pub fn held_by(&self, owner: &K) -> usize {
        self.held.get(owner).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_fair_share_evicts_the_hog_and_a_hog_is_refused() {
        let mut b = FairBudget::new(100);
        assert_eq!(b.admit(&"hog", 100), Ok(vec![]));
        // Over the budget, but within half (two owners): the hog goes.
        assert_eq!(b.admit(&"small", 50), Ok(vec!["hog"]));
        assert_eq!((b.total(), b.held_by(&"hog")), (50, 0));
        // Within the budget: admitted, whatever the share.
        assert_eq!(b.admit(&"third", 50), Ok(vec![]));
        // Over the budget and over the fair share (33): refused, nothing changes.
        let err = b.admit(&"hog", 40).unwrap_err();
        assert_eq!((err.fair_share, err.wanted, err.total), (33, 40, 100));
        assert_eq!((b.total(), b.held_by(&"hog")), (100, 0));
        // Shrinking is always admitted.
        assert_eq!(b.admit(&"third", 10), Ok(vec![]));
        assert_eq!(b.admit(&"hog", 40), Ok(vec![]));
        assert_eq!(b.total(), 100);
    }

    #[test]
    fn released_owners_give_their_bytes_back() {
        let mut b = FairBudget::new(10);
        b.admit(&1, 6).unwrap();
        b.admit(&2, 4).unwrap();
        b.release(&1);
        assert_eq!(b.total(), 4);
        b.retain(|k| *k != 2);
        assert_eq!(b.total(), 0);
        b.admit(&3, 10).unwrap();
        b.admit(&3, 0).unwrap();
        assert_eq!(b.total(), 0);
    }

    proptest! {
        /// Whatever the sequence: the total is the sum of what is held and never over
        /// the budget; a request within the fair share is never refused; a refusal
        /// changes nothing; only owners over the fair share are evicted.
        #[test]
        fn the_budget_holds_and_fair_shares_are_admitted(
            ops in proptest::collection::vec((0u8..8, 0usize..400, any::<bool>()), 1..200)
        ) {
            let budget = 300;
            let mut b = FairBudget::new(budget);
            for (owner, size, release) in ops {
                if release {
                    b.release(&owner);
                } else {
                    let owners = b.held.len() + usize::from(!b.held.contains_key(&owner));
                    let fair = budget / owners;
                    let before = b.held.clone();
                    match b.admit(&owner, size.min(budget)) {
                        Ok(evicted) => {
                            prop_assert_eq!(b.held_by(&owner), size.min(budget));
                            for e in evicted {
                                prop_assert!(before[&e] > fair);
                                prop_assert_eq!(b.held_by(&e), 0);
                            }
                        }
                        Err(_) => {
                            prop_assert!(size > fair);
                            prop_assert_eq!(&b.held, &before);
                        }
                    }
                }
                prop_assert_eq!(b.total(), b.held.values().sum::<usize>());
                prop_assert!(b.total() <= budget);
            }
        }
    }
}
