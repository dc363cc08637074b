//! The ports ray-xds serves, and the servers on them.
//!
//! Every port is bound before any component starts, so a port taken is an error at
//! start and a test can bind port 0 and read the port back. The xDS server answers
//! only once the pipeline has published a first snapshot; the admin server runs on a
//! thread and runtime of its own, so `/healthz` and `/readyz` never queue behind the
//! main runtime's work.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::starter::Starter;
use crate::admin::{self, AdminState};
use crate::config::Config;
use crate::xds::grpc::AdsService;
use crate::xds::server::AdsServer;
use crate::xds::{Clients, Snapshot};

/// The ports ray-xds serves, bound before anything starts (so a test can bind port 0
/// and read the port back).
pub(super) struct Listeners {
    pub(super) xds: TcpListener,
    pub(super) admin: TcpListener,
    pub(super) debug: Option<TcpListener>,
}

impl Listeners {
    pub(super) async fn bind(config: &Config) -> anyhow::Result<Listeners> {
        let xds = TcpListener::bind(config.xds_listen)
            .await
            .with_context(|| format!("binding the xDS listener on {}", config.xds_listen))?;
        let admin = TcpListener::bind(config.admin_listen)
            .await
            .with_context(|| format!("binding the admin listener on {}", config.admin_listen))?;
        let debug = match config.admin_debug_listen {
            Some(addr) => Some(TcpListener::bind(addr).await.with_context(|| {
                format!("binding the admin debug listener (admin.debug_listen) on {addr}")
            })?),
            None => None,
        };
        Ok(Listeners { xds, admin, debug })
    }

    pub(super) fn addresses(
        &self,
    ) -> std::io::Result<(SocketAddr, SocketAddr, Option<SocketAddr>)> {
        let debug = self
            .debug
            .as_ref()
            .map(TcpListener::local_addr)
            .transpose()?;
        Ok((self.xds.local_addr()?, self.admin.local_addr()?, debug))
    }
}

impl Starter<'_> {
    /// The xDS server, once there is a first snapshot, and the watch on its TLS files.
    pub(super) fn xds_server(
        &mut self,
        listener: TcpListener,
        tls: Option<Arc<crate::xds::tls::ServerTls>>,
        snapshots: watch::Receiver<Arc<Snapshot>>,
        mut published: watch::Receiver<Option<Arc<Snapshot>>>,
        clients: &Arc<Clients>,
        loads: Arc<crate::xds::lrs::LoadReports>,
    ) {
        let config = self.config;
        let ads = AdsServer::new(
            snapshots,
            self.metrics.clone(),
            clients.clone(),
            self.shutdown.clone(),
        )
        .with_max_streams(config.xds_max_streams)
        .with_response_bytes(config.memory.xds_responses)
        .with_write_deadline(config.xds_limits.write_deadline);
        self.metrics
            .count_responses_of(ads.response_bytes().clone());
        let limits = config.xds_limits;
        let partial =
            crate::xds::codec::PartialRequests::with_limit(config.memory.partial_xds_requests);
        let service = AdsService::new(ads, config.xds_max_message_bytes)
            .with_partial_requests(partial.clone());
        let observer: Arc<dyn crate::xds::Observer> = self.metrics.clone();
        // Envoy's load reports, on the same port, sharing the bound on requests not yet
        // whole.
        let load_reporting = crate::xds::lrs::LrsService::new(
            loads,
            clients.clone(),
            observer.clone(),
            config.xds_max_message_bytes,
            self.shutdown.clone(),
        )
        .with_partial_requests(partial.clone());
        // What each Envoy holds, for tools that speak CSDS, on the same port, sharing the
        // bound on requests not yet whole.
        let client_status = crate::xds::csds::Csds::new(clients.clone(), published.clone())
            .with_partial_requests(partial);
        if let Some(tls) = &tls {
            let watch = crate::xds::tls::watch(
                tls.clone(),
                crate::xds::tls::RELOAD_INTERVAL,
                observer.clone(),
                self.shutdown.clone(),
            );
            self.spawn(async move {
                watch.await;
                Ok(())
            });
        }
        let token = self.shutdown.clone();
        self.spawn(async move {
            tokio::select! {
                _ = token.cancelled() => return Ok(()),
                ready = published.wait_for(|s| s.is_some()) => if ready.is_err() { return Ok(()) },
            }
            let (incoming, accepting) =
                crate::xds::listener::incoming(listener, limits, Default::default(), observer, tls);
            let served = tonic::transport::Server::builder()
                // A peer that stops answering pings is closed; one connection serves at
                // most this many streams (an Envoy opens one).
                .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
                .max_concurrent_streams(Some(crate::xds::server::MAX_STREAMS_PER_CONNECTION))
                .add_service(service)
                .add_service(load_reporting)
                .add_service(client_status)
                .serve_with_incoming_shutdown(incoming, token.cancelled_owned())
                .await
                .context("xDS server");
            // The server has dropped its connection stream, so the accept loop is ending:
            // wait for it to close the listening socket before saying the server stopped.
            let _ = accepting.await;
            served
        });
    }

    /// The admin port, on a thread and runtime of its own: with thousands of probes
    /// queued on the main runtime, `/healthz` and `/readyz` do not wait behind them (the
    /// kernel shares the cores between the threads instead).
    pub(super) fn admin(
        &mut self,
        listener: TcpListener,
        debug: Option<TcpListener>,
        state: AdminState,
    ) -> anyhow::Result<()> {
        let token = self.shutdown.clone();
        let listener = listener
            .into_std()
            .context("moving the admin listener to its thread")?;
        let debug = debug
            .map(TcpListener::into_std)
            .transpose()
            .context("moving the admin debug listener to its thread")?;
        let (admin_done, admin_ended) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("ray-xds-admin".into())
            .spawn(move || {
                let served = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .and_then(|runtime| {
                        runtime.block_on(async move {
                            let listener = tokio::net::TcpListener::from_std(listener)?;
                            let debug = debug.map(tokio::net::TcpListener::from_std).transpose()?;
                            admin::serve(listener, debug, state, token).await
                        })
                    });
                let _ = admin_done.send(served);
            })
            .context("starting the admin thread")?;
        self.spawn(async move {
            admin_ended
                .await
                .unwrap_or_else(|_| Err(std::io::Error::other("the admin thread panicked")))
                .context("admin server")
        });
        Ok(())
    }
}
