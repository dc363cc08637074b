//! mTLS on the xDS listener, with real Envoys (`envoy/bootstrap-tls.yaml`) and
//! certificates made in the test: an Envoy with a client certificate gets its config
//! (state of the world and delta); one without, with another CA's, or over plain TCP is
//! refused before any xDS message; certificate files rotated under a live Envoy reach new
//! handshakes without dropping its stream; a bad rotation keeps the last good files.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ray_serve_sim::NodeType;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use support::tls::{foreign_client_pem, TestPki};
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

/// ray-xds with mTLS on its xDS port, its files in a folder of their own (so a rotation
/// there is seen by ray-xds only; each Envoy reads copies made when it starts).
struct TlsStack {
    stack: Stack,
    pki: TestPki,
    server_dir: PathBuf,
    /// Every file of the test's certificates (and each Envoy's copies).
    dir: tempfile::TempDir,
}

impl TlsStack {
    async fn start(sim: &SimCluster) -> TlsStack {
        let dir = tempfile::tempdir().unwrap();
        let pki = TestPki::new(&dir.path().join("pki"));
        let server_dir = dir.path().join("server");
        std::fs::create_dir_all(&server_dir).unwrap();
        for (from, to) in [
            (&pki.server_cert_path, "tls.crt"),
            (&pki.server_key_path, "tls.key"),
            (&pki.ca_pem_path, "ca.crt"),
        ] {
            std::fs::copy(from, server_dir.join(to)).unwrap();
        }
        let files = ray_xds::xds::tls::TlsFiles {
            cert: server_dir.join("tls.crt"),
            key: server_dir.join("tls.key"),
            client_ca: server_dir.join("ca.crt"),
        };
        let stack = Stack::with(services_yaml("demo-a", &[sim]))
            .config(move |c| c.xds_tls = Some(files))
            .start()
            .await;
        TlsStack {
            stack,
            pki,
            server_dir,
            dir,
        }
    }

    fn xds_port(&self) -> u16 {
        self.stack.xds.xds_addr.port()
    }

    /// An Envoy on the TLS bootstrap presenting `client` (certificate, key PEM; `None`:
    /// no certificate at all), `api_type` GRPC or DELTA_GRPC.
    fn envoy(&self, client: Option<(String, String)>, api_type: &str) -> Envoy {
        let dir = tempfile::tempdir_in(self.dir.path()).unwrap().keep();
        let cert = dir.join("tls.crt");
        let key = dir.join("tls.key");
        let ca = dir.join("ca.crt");
        std::fs::copy(&self.pki.ca_pem_path, &ca).unwrap();
        let with_cert = client.is_some();
        if let Some((c, k)) = client {
            std::fs::write(&cert, c).unwrap();
            std::fs::write(&key, k).unwrap();
        }
        let files = Bootstrap::with_tls_files(&cert, &key, &ca);
        let api_type = api_type.to_string();
        Envoy::start_with(Bootstrap::SotwTls, self.xds_port(), move |b| {
            let mut b = files(b).replace("api_type: GRPC", &format!("api_type: {api_type}"));
            if !with_cert {
                let start = b.find("            tls_certificates:").unwrap();
                let end = b.find("            validation_context:").unwrap();
                b.replace_range(start..end, "");
            }
            b
        })
    }

    async fn metrics(&self) -> String {
        self.stack.admin("/metrics").await
    }

    async fn handshake_failures(&self) -> f64 {
        metric(
            &self.metrics().await,
            "ray_xds_xds_stream_errors_total{protocol=\"connection\",reason=\"tls_handshake\"}",
        )
    }

    async fn clients(&self) -> Vec<serde_json::Value> {
        let v: serde_json::Value =
            serde_json::from_str(&self.stack.admin("/debug/clients").await).unwrap();
        v["clients"].as_array().cloned().unwrap_or_default()
    }

    fn client_pem(&self) -> (String, String) {
        (
            std::fs::read_to_string(&self.pki.client_cert_path).unwrap(),
            std::fs::read_to_string(&self.pki.client_key_path).unwrap(),
        )
    }
}

async fn traffic_flows(envoy: &Envoy) -> u16 {
    let port = envoy.gateway_port().await;
    eventually("traffic flows through Envoy", DEADLINE, || async {
        through_envoy(port).await
    })
    .await;
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_with_a_client_certificate_get_their_config_over_mtls() {
    let sim = SimCluster::start("demo-a", &[NodeType::Head, NodeType::Worker]).await;
    let s = TlsStack::start(&sim).await;
    let sotw = s.envoy(Some(s.client_pem()), "GRPC");
    let delta = s.envoy(Some(s.pki.client_pem("sidecar")), "DELTA_GRPC");
    traffic_flows(&sotw).await;
    traffic_flows(&delta).await;
    let mut protocols: Vec<String> = s
        .clients()
        .await
        .iter()
        .map(|c| c["protocol"].as_str().unwrap().to_string())
        .collect();
    protocols.sort();
    assert_eq!(protocols, ["delta", "sotw"]);
    assert_eq!(s.handshake_failures().await, 0.0);
    // Envoy's side: its xDS connection is TLS.
    assert!(sotw.stat("cluster.ray-xds.ssl.handshake").await >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_a_certificate_the_client_ca_signed_are_refused_before_any_xds_message() {
    let sim = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let s = TlsStack::start(&sim).await;

    // No certificate, another CA's certificate, and no TLS at all: each Envoy retries its
    // connection, and each attempt fails in the handshake.
    let no_cert = s.envoy(None, "GRPC");
    let foreign = s.envoy(Some(foreign_client_pem()), "DELTA_GRPC");
    let plain = Envoy::start(Bootstrap::Sotw, s.xds_port());
    for (name, envoy) in [
        ("no certificate", &no_cert),
        ("foreign CA", &foreign),
        ("plain TCP", &plain),
    ] {
        eventually(
            &format!("the {name} Envoy tried to connect at least twice"),
            DEADLINE,
            || async { (envoy.stat("cluster.ray-xds.upstream_cx_total").await >= 2).then_some(()) },
        )
        .await;
    }
    let failures = s.handshake_failures().await;
    assert!(
        failures >= 6.0,
        "every refused connection is counted: {failures}"
    );
    // Nothing was read from them: no stream, no client, no config on their side.
    assert!(s.clients().await.is_empty(), "{:?}", s.clients().await);
    for envoy in [&no_cert, &foreign, &plain] {
        assert_eq!(envoy.stat("cluster_manager.cds.update_success").await, 0);
        assert_eq!(envoy.stat("listener_manager.lds.update_success").await, 0);
    }
    assert!(metric(&s.metrics().await, "ray_xds_xds_streams{protocol=\"sotw\"}") == 0.0);

    // A raw TLS client the CA signed, speaking no HTTP/2 yet, is let through the
    // handshake (and the listener's preface deadline then applies as on plain TCP).
    let (cert, key) = s.client_pem();
    let conn = tls_connect(s.xds_port(), &s.pki.ca_pem_path, Some((&cert, &key))).await;
    assert!(conn.is_ok(), "{:?}", conn.err());

    // And a well-certified Envoy beside them is served.
    let good = s.envoy(Some(s.client_pem()), "GRPC");
    traffic_flows(&good).await;
    assert_eq!(s.clients().await.len(), 1);
}

/// A TLS connection to ray-xds's xDS port trusting `ca`, presenting `client`; returns the
/// certificate ray-xds presented. With TLS 1.3 a refused client certificate shows on the
/// first read, so this writes the HTTP/2 preface and reads the server's SETTINGS.
async fn tls_connect(
    port: u16,
    ca: &Path,
    client: Option<(&str, &str)>,
) -> Result<CertificateDer<'static>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let mut tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .map_err(|e| e.to_string())?;
    let mut frame = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(10), tls.read_exact(&mut frame))
        .await
        .map_err(|_| "no answer".to_string())?
        .map_err(|e| e.to_string())?;
    if frame[3] != 4 {
        return Err(format!("not a SETTINGS frame: {frame:?}"));
    }
    let presented = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    Ok(presented.into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificates_reach_new_handshakes_without_dropping_a_stream() {
    let a = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let b = SimCluster::start("demo-b", &[NodeType::Head]).await;
    let s = TlsStack::start(&a).await;
    s.stack.edit(&services_yaml("demo-a", &[&a, &b]));
    let live = s.envoy(Some(s.client_pem()), "GRPC");
    let port = traffic_flows(&live).await;
    let (cert, key) = s.client_pem();
    let before = tls_connect(s.xds_port(), &s.pki.ca_pem_path, Some((&cert, &key)))
        .await
        .unwrap();
    let connections = live.stat("cluster.ray-xds.upstream_cx_total").await;
    assert_eq!(connections, 1);

    // The server's certificate and key rotated, as cert-manager does: a new key pair.
    let new_cert = s
        .pki
        .issue_server(&s.server_dir.join("tls.crt"), &s.server_dir.join("tls.key"));
    eventually("ray-xds loads the rotated files", DEADLINE, || async {
        (metric(
            &s.metrics().await,
            "ray_xds_xds_tls_reloads_total{result=\"ok\"}",
        ) == 1.0)
            .then_some(())
    })
    .await;
    let after = tls_connect(s.xds_port(), &s.pki.ca_pem_path, Some((&cert, &key)))
        .await
        .unwrap();
    assert_ne!(before, after, "a new handshake gets the new certificate");
    assert_eq!(
        after,
        CertificateDer::from_pem_slice(new_cert.as_bytes()).unwrap()
    );

    // The live Envoy's stream went on: a change still reaches it, on the same connection.
    s.stack.edit(&services_yaml("demo-b", &[&a, &b]));
    eventually(
        "the live Envoy follows an edit after the rotation",
        DEADLINE,
        || async { through_envoy(port).await.filter(|x| x.cluster == "demo-b") },
    )
    .await;
    assert_eq!(live.stat("cluster.ray-xds.upstream_cx_total").await, 1);
    assert_eq!(live.stat("control_plane.connected_state").await, 1);

    // A new Envoy trusts the new certificate (same CA) and is served.
    let next = s.envoy(Some(s.pki.client_pem("next")), "DELTA_GRPC");
    traffic_flows(&next).await;

    // A client CA rotated to a new CA only: clients of the old CA are refused from now
    // on, and the connected Envoy's stream still goes on.
    let new_ca = TestPki::new(&s.pki.dir.join("next-ca"));
    std::fs::copy(&new_ca.ca_pem_path, s.server_dir.join("ca.tmp")).unwrap();
    std::fs::rename(s.server_dir.join("ca.tmp"), s.server_dir.join("ca.crt")).unwrap();
    eventually("ray-xds loads the new client CA", DEADLINE, || async {
        (metric(
            &s.metrics().await,
            "ray_xds_xds_tls_reloads_total{result=\"ok\"}",
        ) == 2.0)
            .then_some(())
    })
    .await;
    let refused = tls_connect(s.xds_port(), &s.pki.ca_pem_path, Some((&cert, &key))).await;
    assert!(refused.is_err(), "the old CA's client is refused now");
    let (new_client_cert, new_client_key) = new_ca.client_pem("new");
    tls_connect(
        s.xds_port(),
        &s.pki.ca_pem_path,
        Some((&new_client_cert, &new_client_key)),
    )
    .await
    .expect("the new CA's client is let in");
    s.stack.edit(&services_yaml("demo-a", &[&a, &b]));
    eventually(
        "the live Envoy follows an edit after the CA rotation",
        DEADLINE,
        || async { through_envoy(port).await.filter(|x| x.cluster == "demo-a") },
    )
    .await;
    assert_eq!(live.stat("cluster.ray-xds.upstream_cx_total").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_rotation_is_counted_and_the_last_good_files_go_on_serving() {
    let sim = SimCluster::start("demo-a", &[NodeType::Head]).await;
    let s = TlsStack::start(&sim).await;
    let (cert, key) = s.client_pem();
    let before = tls_connect(s.xds_port(), &s.pki.ca_pem_path, Some((&cert, &key)))
        .await
        .unwrap();

    // Garbage where the certificate was.
    std::fs::write(
        s.server_dir.join("tls.crt"),
        "-----BEGIN CERTIFICATE-----\nnope\n",
    )
    .unwrap();
    eventually("the bad file is counted", DEADLINE, || async {
        (metric(
            &s.metrics().await,
            "ray_xds_xds_tls_reloads_total{result=\"error\"}",
        ) >= 1.0)
            .then_some(())
    })
    .await;
    let still = tls_connect(s.xds_port(), &s.pki.ca_pem_path, Some((&cert, &key)))
        .await
        .expect("the last good files still serve");
    assert_eq!(before, still);
    let envoy = s.envoy(Some(s.client_pem()), "GRPC");
    traffic_flows(&envoy).await;
    assert_eq!(
        metric(
            &s.metrics().await,
            "ray_xds_xds_tls_reloads_total{result=\"ok\"}"
        ),
        0.0
    );
}
