//! How a simulated proxy behaves right now ([`ProxyMode`]), and its spelling on the
//! control endpoint and the command line (`serving`, `draining`, `slow:<ms>`, ...).

/// How a simulated proxy behaves right now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ProxyMode {
    #[default]
    Serving,
    /// `/-/healthz` and `/-/routes` answer 503 `This node is being drained.`;
    /// application requests are still served.
    Draining,
    /// `/-/healthz` and `/-/routes` answer 503 `Route table is not populated yet.`
    NotReady,
    /// A worker node's proxy whose route table is populated but whose applications have no
    /// running replica yet: `/-/healthz` and `/-/routes` answer 503 `No replicas are
    /// available yet.` (Ray's `NO_REPLICAS_MESSAGE`), and application requests are held,
    /// unanswered, until the mode changes (as Ray holds a request to an application
    /// that has no replica up yet), then go on under the new mode.
    NoReplicas,
    /// Accepts connections and never answers.
    Hang,
    /// Every answer waits this long first.
    Slow(std::time::Duration),
    /// `/-/healthz` alternates between success and a 500, request by request.
    Flapping,
    /// Healthy, but application requests get 503 (Ray's backpressure: nothing ran).
    Overloaded,
    /// Reads an application request in full (it runs), then closes the connection
    /// without answering, as a proxy that dies mid-request.
    ResetAfterRead,
    /// A bad version of the application: healthy, and this percent of its requests run
    /// and are answered 500 (Ray's answer to an exception in the application), spread
    /// evenly (every request `n` where `n × percent / 100` steps up). HTTP only: gRPC
    /// calls are served as under `Serving`.
    Failing(u8),
    /// An ingress replica (Ray's direct ingress) that is stopping: `/-/healthz` answers 503
    /// `DRAINING` (gRPC `Healthz`: `UNAVAILABLE` `DRAINING`), as Ray 2.60's replicas do
    /// while they finish what they hold; application requests are still served.
    ReplicaDraining,
}

impl std::str::FromStr for ProxyMode {
    type Err = String;
    /// `serving`, `draining`, `not-ready`, `no-replicas`, `hang`, `flapping`, `overloaded`,
    /// `reset-after-read`, `replica-draining`, `slow:<milliseconds>` or
    /// `failing:<percent>`.
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "serving" => ProxyMode::Serving,
            "draining" => ProxyMode::Draining,
            "not-ready" => ProxyMode::NotReady,
            "no-replicas" => ProxyMode::NoReplicas,
            "hang" => ProxyMode::Hang,
            "flapping" => ProxyMode::Flapping,
            "overloaded" => ProxyMode::Overloaded,
            "reset-after-read" => ProxyMode::ResetAfterRead,
            "replica-draining" => ProxyMode::ReplicaDraining,
            other => {
                let slow = other.strip_prefix("slow:").and_then(|ms| ms.parse().ok());
                let failing = other
                    .strip_prefix("failing:")
                    .and_then(|p| p.parse::<u8>().ok())
                    .filter(|p| *p <= 100);
                match (slow, failing) {
                    (Some(ms), _) => ProxyMode::Slow(std::time::Duration::from_millis(ms)),
                    (_, Some(percent)) => ProxyMode::Failing(percent),
                    _ => {
                        return Err(format!(
                            "unknown proxy mode {other:?}: serving, draining, not-ready, no-replicas, hang, flapping, overloaded, reset-after-read, replica-draining, slow:<ms> or failing:<percent>"
                        ))
                    }
                }
            }
        })
    }
}
