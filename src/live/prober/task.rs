//! One endpoint's probe loop: a probe every interval (urgent for a first probe and for
//! the quick re-probe that confirms a failure), hedged rounds under shared permits, and
//! the proxy's `/-/routes` read on its turn.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Semaphore};

use super::*;

pub(super) struct ProbeTask {
    pub(super) address: SocketAddr,
    pub(super) settings: ProbePolicy,
    /// HTTP: `GET /-/healthz` (and `/-/routes`); gRPC: `Healthz` (no routes: the gRPC
    /// proxy picks the application from the call's `application` metadata).
    pub(super) protocol: Protocol,
    pub(super) read_routes: bool,
    pub(super) routes_interval: Duration,
    pub(super) client: HttpClient,
    pub(super) permits: ProbePermits,
    pub(super) reports: mpsc::Sender<Report>,
}

/// Probes in flight, at most `max_concurrent` in all. An eighth of the permits is kept
/// for urgent probes: a proxy's first (a new proxy is withheld from Envoy until it), and
/// the quick re-probe that confirms a healthy proxy's failure (how fast a hung proxy is
/// found). They take whichever permit frees first; routine probes only the rest, so with
/// thousands of proxies an urgent probe never waits behind a full round of routine ones.
/// A sixteenth is for hedged probes only, taken if free at once and never waited for.
#[derive(Clone)]
pub(super) struct ProbePermits {
    pub(super) routine: Arc<Semaphore>,
    pub(super) urgent: Arc<Semaphore>,
    pub(super) hedges: Arc<Semaphore>,
    /// Turns to read `/-/routes` ([`ROUTE_READS_AT_ONCE`], shared between clusters).
    pub(super) route_reads: Arc<RouteTurns>,
}

impl ProbePermits {
    pub(super) fn new(max_concurrent: usize) -> ProbePermits {
        let total = max_concurrent.clamp(1, Semaphore::MAX_PERMITS);
        let (urgent, hedges) = (total / 8, total / 16);
        ProbePermits {
            routine: Arc::new(Semaphore::new(total - urgent - hedges)),
            urgent: Arc::new(Semaphore::new(urgent)),
            hedges: Arc::new(Semaphore::new(hedges)),
            route_reads: RouteTurns::new(ROUTE_READS_AT_ONCE),
        }
    }

    /// A permit; `None` once closed (never, today).
    pub(super) async fn acquire(&self, urgent: bool) -> Option<tokio::sync::SemaphorePermit<'_>> {
        if !urgent {
            return self.routine.acquire().await.ok();
        }
        tokio::select! {
            biased;
            permit = self.urgent.acquire() => permit.ok(),
            permit = self.routine.acquire() => permit.ok(),
        }
    }
}

impl ProbeTask {
    pub(super) async fn run(self) {
        // The last outcome reported was healthy (routes are read on turning healthy).
        let mut last_healthy = false;
        // The last outcome other than a failure was healthy, and fewer than
        // `unhealthy_threshold` failures followed it: the proxy is (still) healthy as far
        // as this task knows, so a failure is worth confirming quickly.
        let mut trusted = false;
        // Failures reported since the last other outcome.
        let mut failures: u32 = 0;
        let mut routes_read: Option<Instant> = None;
        let mut next = Duration::ZERO;
        let mut urgent = true; // the first probe
                               // One HTTP/2 connection per gRPC proxy, opened at the first probe and reopened
                               // as needed (tonic's channel reconnects).
        let grpc = (self.protocol == Protocol::Grpc).then(|| grpc_channel(self.address));
        loop {
            tokio::time::sleep(next).await;
            let Some(permit) = self.permits.acquire(urgent).await else {
                return;
            };
            // A trusted proxy's probe that has not answered within the hedge delay is
            // confirmed by a second one sent at once, unless a failure of the first alone
            // would reach the threshold (then there is nothing to confirm).
            let hedge =
                (trusted && grpc.is_none() && failures + 1 < self.settings.unhealthy_threshold)
                    .then(|| self.settings.hedge_after());
            let mut round = Round::new(self.probe_once(&grpc, permit), hedge);
            // Failures are reported as they come (the first never waits for the second);
            // the first answer that is not a failure ends the round, and a probe still in
            // flight then is dropped (it could only add a stale failure).
            let decided = loop {
                let hedged = || {
                    let permit = self.permits.hedges.try_acquire().ok()?;
                    Some(self.probe_once(&grpc, permit))
                };
                match round.next(hedged).await {
                    None => break None,
                    Some((Outcome::Failed(why), latency)) => {
                        failures += 1;
                        trusted &= failures < self.settings.unhealthy_threshold;
                        last_healthy = false;
                        let report = Report {
                            address: self.address,
                            outcome: Outcome::Failed(why),
                            latency,
                            routes: None,
                            route_read_turn: None,
                        };
                        if self.reports.send(report).await.is_err() {
                            return;
                        }
                    }
                    Some(decided) => break Some(decided),
                }
            };
            // Whatever is still in flight (and its permit) goes before any route read.
            drop(round);
            if let Some((outcome, latency)) = decided {
                let healthy = outcome == Outcome::Healthy;
                let (routes, route_read_turn) = if healthy
                    && grpc.is_none()
                    && self.read_routes
                    && (!last_healthy
                        || routes_read.is_none_or(|t| t.elapsed() >= self.routes_interval))
                {
                    let turns = &self.permits.route_reads;
                    match turns.take(self.address, self.settings.timeout).await {
                        Some(turn) => {
                            routes_read = Some(Instant::now());
                            match read_routes(&self.client, self.address, self.settings.timeout)
                                .await
                            {
                                Ok(table) => (Some(table), Some(turn)),
                                // No answer in time (a busy proxy): not read this time
                                // (its last table stays).
                                Err(_) => (None, None),
                            }
                        }
                        // No turn (its cluster holds its share, or none freed in time):
                        // not read this time (its last table stays).
                        None => (None, None),
                    }
                } else {
                    (None, None)
                };
                failures = 0;
                trusted = healthy;
                last_healthy = healthy;
                let report = Report {
                    address: self.address,
                    outcome,
                    latency,
                    routes,
                    route_read_turn,
                };
                if self.reports.send(report).await.is_err() {
                    return;
                }
            }
            // ±20% jitter so that proxies added together do not probe in lockstep; a
            // trusted proxy that failed (fast, or once with no hedge to confirm it) is
            // probed again soon, so that it reaches the failure threshold in a fraction
            // of the interval.
            let suspect = trusted && failures > 0;
            next = if suspect {
                self.settings.interval / 5
            } else {
                self.settings.interval.mul_f64(0.8 + fastrand::f64() * 0.4)
            };
            urgent = suspect;
        }
    }

    /// One probe (`GET /-/healthz` or gRPC `Healthz`) and how long it took, under
    /// `permit`.
    fn probe_once<'a>(
        &'a self,
        grpc: &'a Option<tonic::transport::Channel>,
        permit: tokio::sync::SemaphorePermit<'a>,
    ) -> ProbeFuture<'a> {
        Box::pin(async move {
            let _permit = permit;
            let started = Instant::now();
            let outcome = match grpc {
                None => probe_healthz(&self.client, self.address, self.settings.timeout).await,
                Some(channel) => probe_grpc_healthz(channel.clone(), self.settings.timeout).await,
            };
            (outcome, started.elapsed())
        })
    }
}

pub(super) type ProbeFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = (Outcome, Duration)> + Send + 'a>>;

/// One probe round: the first probe and, when `hedge` is given and the first has not
/// answered by then, a second probe started alongside it.
pub(super) struct Round<'a> {
    first: Option<ProbeFuture<'a>>,
    second: Option<ProbeFuture<'a>>,
    /// When the second probe starts, until it has (or the first has answered).
    hedge: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<'a> Round<'a> {
    fn new(first: ProbeFuture<'a>, hedge: Option<Duration>) -> Round<'a> {
        Round {
            first: Some(first),
            second: None,
            hedge: hedge.map(|d| Box::pin(tokio::time::sleep(d))),
        }
    }

    /// The next probe to finish, in the order they finish; `None` once none is left.
    /// `start` makes the hedged probe when its time comes (`None`: no permit free, no
    /// hedge this round).
    async fn next(
        &mut self,
        start: impl FnOnce() -> Option<ProbeFuture<'a>>,
    ) -> Option<(Outcome, Duration)> {
        let mut start = Some(start);
        loop {
            let Round {
                first,
                second,
                hedge,
            } = &mut *self;
            let (first_left, second_left, hedge_left) =
                (first.is_some(), second.is_some(), hedge.is_some());
            if !first_left && !second_left {
                return None;
            }
            tokio::select! {
                r = async { first.as_mut().unwrap().await }, if first_left => {
                    *first = None;
                    // Answered before the hedge delay: nothing to confirm in this round.
                    *hedge = None;
                    return Some(r);
                }
                r = async { second.as_mut().unwrap().await }, if second_left => {
                    *second = None;
                    return Some(r);
                }
                _ = async { hedge.as_mut().unwrap().await }, if hedge_left => {
                    *hedge = None;
                    if let Some(start) = start.take() {
                        *second = start();
                    }
                }
            }
        }
    }
}
