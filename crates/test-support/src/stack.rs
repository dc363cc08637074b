//! A ray-xds over a `services.yaml` (and, when asked, a real Envoy in front of it): the
//! set-up most integration tests share, so that each states only what differs.
//!
//! ```ignore
//! let s = Stack::with(services_yaml("demo-a", &[&sim]))
//!     .config(|c| c.policies.probe.interval = Duration::from_secs(60))
//!     .envoy(Bootstrap::Sotw)
//!     .start()
//!     .await;
//! through_envoy(s.gateway_port).await;
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ray_xds::config::Config;
use ray_xds::runtime::Running;

use super::{admin_get, eventually, test_config, through_envoy, write_atomic, Bootstrap, Envoy};

pub struct Stack {
    pub dir: tempfile::TempDir,
    /// The services file ray-xds watches.
    pub services: PathBuf,
    pub xds: Running,
    /// The Envoy, when the builder asked for one.
    pub envoy: Option<Envoy>,
    /// Envoy's `ray-serve-http` listener port (0 without an Envoy).
    pub gateway_port: u16,
}

type Tweak = Box<dyn FnOnce(&mut Config)>;

pub struct StackBuilder {
    services: String,
    tweaks: Vec<Tweak>,
    envoy: Option<(Bootstrap, bool)>,
}

impl Stack {
    /// A stack whose services file starts as `services_yaml`.
    pub fn with(services_yaml: impl Into<String>) -> StackBuilder {
        StackBuilder {
            services: services_yaml.into(),
            tweaks: Vec::new(),
            envoy: None,
        }
    }

    pub fn envoy(&self) -> &Envoy {
        self.envoy.as_ref().expect("this stack has an Envoy")
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.xds.admin_addr
    }

    /// Replaces the services file, atomically (as editors and ConfigMaps do).
    pub fn edit(&self, services_yaml: &str) {
        write_atomic(&self.services, services_yaml);
    }

    /// GET on ray-xds's admin port.
    pub async fn admin(&self, path: &str) -> String {
        admin_get(self.xds.admin_addr, path).await
    }

    /// `/debug/state` as JSON (`Null` if it does not parse).
    pub async fn state(&self) -> serde_json::Value {
        serde_json::from_str(&self.admin("/debug/state").await).unwrap_or_default()
    }
}

impl StackBuilder {
    /// Changes ray-xds's config before it starts (the default is `test_config`: ports
    /// chosen by the kernel, the file source polled every 500 ms).
    pub fn config(mut self, tweak: impl FnOnce(&mut Config) + 'static) -> Self {
        self.tweaks.push(Box::new(tweak));
        self
    }

    /// Puts a real Envoy in front, and waits until a request through it is served.
    pub fn envoy(mut self, bootstrap: Bootstrap) -> Self {
        self.envoy = Some((bootstrap, true));
        self
    }

    /// Puts a real Envoy in front without waiting for traffic (for tests of what happens
    /// before it flows).
    pub fn envoy_without_waiting(mut self, bootstrap: Bootstrap) -> Self {
        self.envoy = Some((bootstrap, false));
        self
    }

    pub async fn start(self) -> Stack {
        let dir = tempfile::tempdir().unwrap();
        let services = dir.path().join("services.yaml");
        std::fs::write(&services, &self.services).unwrap();
        let mut config = test_config(&services, 0);
        for tweak in self.tweaks {
            tweak(&mut config);
        }
        let xds = ray_xds::runtime::start(config, Default::default())
            .await
            .expect("ray-xds starts");
        let (envoy, gateway_port) = match self.envoy {
            None => (None, 0),
            Some((bootstrap, wait)) => {
                let envoy = Envoy::start(bootstrap, xds.xds_addr.port());
                let port = envoy.gateway_port().await;
                if wait {
                    eventually(
                        "traffic flows through Envoy",
                        Duration::from_secs(30),
                        || async { through_envoy(port).await },
                    )
                    .await;
                }
                (Some(envoy), port)
            }
        };
        Stack {
            dir,
            services,
            xds,
            envoy,
            gateway_port,
        }
    }
}
