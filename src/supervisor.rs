//! Supervision: a component (source, dashboards, discovery, prober, pipeline) that stops
//! on a panic, or returns while ray-xds is not shutting down, is logged, counted
//! (`ray_xds_component_restarts_total`), marked down (`ray_xds_component_up`, `/readyz`,
//! `/debug/state`) and started again after a backoff.
//!
//! Invariants:
//!
//! - A component never dies silently: every stop other than shutdown is a failure with
//!   a reason (the panic's message, or "returned").
//! - Restarting never loses a channel: each component is started from a closure that
//!   clones its channel ends, so what it last published stays in its `watch` until the
//!   new instance publishes (downstream keeps serving the last good state meanwhile).
//! - The backoff doubles from 100 ms to 30 s, and starts over once an instance has run
//!   for a minute, so a component that crashes on every start does not spin a core.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::metrics::{ComponentLabels, Metrics};

/// The first backoff after a failure.
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The longest backoff.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// An instance that ran this long resets the backoff.
pub(crate) const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// How one component is doing.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct ComponentState {
    pub up: bool,
    pub restarts: u64,
    /// Why it last stopped, and when (unix seconds).
    pub last_failure: Option<String>,
    pub last_failure_unix: Option<f64>,
}

/// Every supervised component's state, shared with the admin server.
pub(crate) struct Components {
    states: Mutex<BTreeMap<&'static str, ComponentState>>,
    metrics: Arc<Metrics>,
}

impl Components {
    pub fn new(metrics: Arc<Metrics>) -> Components {
        Components {
            states: Mutex::new(BTreeMap::new()),
            metrics,
        }
    }

    /// Every component and its state.
    pub(crate) fn report(&self) -> BTreeMap<&'static str, ComponentState> {
        self.states.lock().expect("never poisoned").clone()
    }

    /// The components that are down, with why.
    pub(crate) fn down(&self) -> Vec<(&'static str, String)> {
        self.report()
            .into_iter()
            .filter(|(_, s)| !s.up)
            .map(|(name, s)| (name, s.last_failure.unwrap_or_default()))
            .collect()
    }

    fn set_up(&self, name: &'static str) {
        let mut states = self.states.lock().expect("never poisoned");
        states
            .entry(name)
            .or_insert(ComponentState {
                up: true,
                restarts: 0,
                last_failure: None,
                last_failure_unix: None,
            })
            .up = true;
        self.metrics
            .component_up
            .get_or_create(&ComponentLabels { component: name })
            .set(1);
        // At 0 from the start: a series born at its first restart shows no increase().
        let _ = self
            .metrics
            .component_restarts
            .get_or_create(&ComponentLabels { component: name });
    }

    fn set_down(&self, name: &'static str, why: String) {
        let mut states = self.states.lock().expect("never poisoned");
        let state = states.entry(name).or_insert(ComponentState {
            up: false,
            restarts: 0,
            last_failure: None,
            last_failure_unix: None,
        });
        state.up = false;
        state.restarts += 1;
        state.last_failure = Some(why);
        state.last_failure_unix = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .ok()
            .map(|d| d.as_secs_f64());
        self.metrics
            .component_up
            .get_or_create(&ComponentLabels { component: name })
            .set(0);
        self.metrics
            .component_restarts
            .get_or_create(&ComponentLabels { component: name })
            .inc();
    }
}

/// Runs the component `name`, as `start` makes it, until `shutdown`; restarts it each
/// time it fails (see the module doc).
pub(crate) async fn supervise<F, Fut>(
    name: &'static str,
    components: Arc<Components>,
    shutdown: CancellationToken,
    mut start: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut backoff = FIRST_BACKOFF;
    loop {
        components.set_up(name);
        let started = Instant::now();
        let result = tokio::spawn(start()).await;
        if shutdown.is_cancelled() {
            return;
        }
        let why = match result {
            Ok(()) => "returned while ray-xds was running".to_string(),
            Err(e) if e.is_panic() => format!("panicked: {}", panic_message(e.into_panic())),
            Err(e) => format!("stopped: {e}"),
        };
        components.set_down(name, why.clone());
        if started.elapsed() >= HEALTHY_RUN {
            backoff = FIRST_BACKOFF;
        }
        tracing::error!(component = name, reason = %why, retry_in = ?backoff, "component failed; restarting it");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test(start_paused = true)]
    async fn a_panicking_component_is_counted_shown_down_and_restarted() {
        let metrics = Arc::new(Metrics::new());
        let components = Arc::new(Components::new(metrics.clone()));
        let token = CancellationToken::new();
        let starts = Arc::new(AtomicU32::new(0));
        let (s, t) = (starts.clone(), token.clone());
        let task = tokio::spawn(supervise(
            "prober",
            components.clone(),
            token.clone(),
            move || {
                let n = s.fetch_add(1, Ordering::SeqCst);
                let t = t.clone();
                async move {
                    if n < 2 {
                        panic!("boom {n}");
                    }
                    t.cancelled().await;
                }
            },
        ));
        // Two failures, then a healthy third instance.
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if starts.load(Ordering::SeqCst) == 3 {
                break;
            }
        }
        assert_eq!(starts.load(Ordering::SeqCst), 3);
        let report = components.report();
        let state = &report["prober"];
        assert!(state.up);
        assert_eq!(state.restarts, 2);
        assert_eq!(state.last_failure.as_deref(), Some("panicked: boom 1"));
        let text = metrics.render();
        assert!(
            text.contains("ray_xds_component_restarts_total{component=\"prober\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("ray_xds_component_up{component=\"prober\"} 1"),
            "{text}"
        );
        token.cancel();
        task.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_component_that_keeps_failing_stays_down_and_backs_off() {
        let components = Arc::new(Components::new(Arc::new(Metrics::new())));
        let token = CancellationToken::new();
        let starts = Arc::new(AtomicU32::new(0));
        let s = starts.clone();
        let task = tokio::spawn(supervise(
            "source",
            components.clone(),
            token.clone(),
            move || {
                s.fetch_add(1, Ordering::SeqCst);
                async {}
            },
        ));
        // 100 ms, 200, 400, ... 25.6 s, then 30 s each: ~10 starts in a minute, not
        // thousands.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let n = starts.load(Ordering::SeqCst);
        assert!((8..=12).contains(&n), "{n} starts in a minute");
        let down = components.down();
        assert_eq!(down.len(), 1);
        assert_eq!(down[0].0, "source");
        assert!(down[0].1.contains("returned"), "{down:?}");
        token.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn shutdown_is_not_a_failure() {
        let components = Arc::new(Components::new(Arc::new(Metrics::new())));
        let token = CancellationToken::new();
        let t = token.clone();
        let task = tokio::spawn(supervise(
            "pipeline",
            components.clone(),
            token.clone(),
            move || {
                let t = t.clone();
                async move { t.cancelled().await }
            },
        ));
        tokio::task::yield_now().await;
        token.cancel();
        task.await.unwrap();
        assert!(components.down().is_empty());
        assert_eq!(components.report()["pipeline"].restarts, 0);
    }
}
