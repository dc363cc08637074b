//! What one proxy's application requests can run at once, as Ray Serve's router gives
//! them to replicas: `ongoing` requests run (RUNNING replicas × `max_ongoing_requests`),
//! up to `max_queued` more wait in the proxy for one to finish (Ray's
//! `max_queued_requests`, counted per handle, so per proxy), and any beyond are turned
//! away with Ray's 503 before they run (`BackPressureError`). Each request that runs
//! takes `call`.
//!
//! Unset (the default), every request runs at once, as before. A test sets it on a
//! [`ProxyHandle`](crate::ProxyHandle); a `ray-serve-sim` process takes
//! `PUT /proxies/{port}/capacity`. Changing it takes effect at once: more room lets
//! queued requests run; less lets running ones finish.
//!
//! Invariants: at most `ongoing` requests hold a [`Slot`] at a time, at most `max_queued`
//! wait; a request that gave up waiting (its client left) no longer counts as queued.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// How much a proxy's replicas take at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// Requests that run at once.
    pub ongoing: u32,
    /// Requests that may wait for one of them; `None` for no bound (Ray's `-1`, its
    /// default).
    pub max_queued: Option<u32>,
    /// How long a request runs, in milliseconds.
    pub call_ms: u64,
}

/// Ray 2.60's `BackPressureError` text (`ray/serve/exceptions.py`), as its HTTP proxy
/// answers it with 503 and its gRPC proxy with `RESOURCE_EXHAUSTED`.
pub fn backpressure_message(queued: u32, max_queued: u32) -> String {
    format!(
        "Request dropped due to backpressure (num_queued_requests={queued}, \
         max_queued_requests={max_queued})."
    )
}

/// The replicas behind one proxy: its capacity and what runs and waits now.
#[derive(Debug, Default)]
pub struct Replicas {
    state: Mutex<State>,
    freed: Notify,
}

#[derive(Debug, Default)]
struct State {
    capacity: Option<Capacity>,
    running: u32,
    queued: u32,
}

/// What happened to a request that asked to run.
#[derive(Debug)]
pub enum Admission {
    /// It runs: hold the slot (if any) for `call`, then answer.
    Run(Option<Slot>, Duration),
    /// Turned away: Ray's 503 text.
    Refused(String),
}

/// One running request's place; given back when dropped.
#[derive(Debug)]
pub struct Slot(Arc<Replicas>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.lock().running -= 1;
        self.0.freed.notify_waiters();
    }
}

/// A waiting request's place in the queue; given back when dropped (it ran, or its
/// client left).
struct Waiting<'a>(&'a Replicas);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.lock().queued -= 1;
    }
}

impl Replicas {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set(&self, capacity: Option<Capacity>) {
        self.lock().capacity = capacity;
        self.freed.notify_waiters();
    }

    pub fn get(&self) -> Option<Capacity> {
        self.lock().capacity
    }

    /// Requests running and waiting now.
    pub fn load(&self) -> (u32, u32) {
        let s = self.lock();
        (s.running, s.queued)
    }

    /// Runs a request now, queues it until it can run, or turns it away.
    pub async fn admit(self: &Arc<Self>) -> Admission {
        let mut waiting = None;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before the state is read: a slot given back after the read
            // wakes this request.
            freed.as_mut().enable();
            {
                let mut s = self.lock();
                let Some(capacity) = s.capacity else {
                    return Admission::Run(None, Duration::ZERO);
                };
                if s.running < capacity.ongoing {
                    s.running += 1;
                    drop(s);
                    drop(waiting.take());
                    return Admission::Run(
                        Some(Slot(Arc::clone(self))),
                        Duration::from_millis(capacity.call_ms),
                    );
                }
                if waiting.is_none() {
                    if let Some(max) = capacity.max_queued {
                        if s.queued >= max {
                            return Admission::Refused(backpressure_message(s.queued, max));
                        }
                    }
                    s.queued += 1;
                    drop(s);
                    waiting = Some(Waiting(self));
                }
            }
            freed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capacity(ongoing: u32, max_queued: Option<u32>) -> Option<Capacity> {
        Some(Capacity {
            ongoing,
            max_queued,
            call_ms: 100,
        })
    }

    #[tokio::test]
    async fn runs_what_fits_queues_what_may_wait_and_turns_the_rest_away() {
        let replicas = Arc::new(Replicas::default());
        assert!(matches!(replicas.admit().await, Admission::Run(None, _)));
        replicas.set(capacity(2, Some(1)));
        let mut held = vec![];
        for _ in 0..2 {
            match replicas.admit().await {
                Admission::Run(Some(slot), call) => {
                    assert_eq!(call, Duration::from_millis(100));
                    held.push(slot);
                }
                other => panic!("{other:?}"),
            }
        }
        let queued = tokio::spawn({
            let replicas = Arc::clone(&replicas);
            async move { replicas.admit().await }
        });
        while replicas.load() != (2, 1) {
            tokio::task::yield_now().await;
        }
        match replicas.admit().await {
            Admission::Refused(text) => assert_eq!(
                text,
                "Request dropped due to backpressure (num_queued_requests=1, \
                 max_queued_requests=1)."
            ),
            other => panic!("{other:?}"),
        }
        // A slot given back lets the queued request run.
        held.pop();
        assert!(matches!(queued.await.unwrap(), Admission::Run(Some(_), _)));
        assert_eq!(replicas.load(), (1, 0));
    }

    #[tokio::test]
    async fn a_client_that_leaves_the_queue_frees_its_place_and_more_room_runs_the_queue() {
        let replicas = Arc::new(Replicas::default());
        replicas.set(capacity(1, None));
        let Admission::Run(Some(_slot), _) = replicas.admit().await else {
            panic!()
        };
        let gave_up = tokio::time::timeout(Duration::from_millis(20), replicas.admit()).await;
        assert!(gave_up.is_err());
        assert_eq!(replicas.load(), (1, 0), "the one that left is not queued");
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                let replicas = Arc::clone(&replicas);
                tokio::spawn(async move { replicas.admit().await })
            })
            .collect();
        while replicas.load() != (1, 3) {
            tokio::task::yield_now().await;
        }
        replicas.set(capacity(4, None));
        for w in waiting {
            assert!(matches!(w.await.unwrap(), Admission::Run(Some(_), _)));
        }
    }
}
