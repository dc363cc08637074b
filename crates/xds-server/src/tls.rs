//! mTLS for the xDS listener: the certificate ray-xds presents and the CAs whose client
//! certificates may connect, read from PEM files (`xds.tls`) and read again when they
//! change, as cert-manager rotates a mounted Secret.
//!
//! Invariants:
//! - a client without a certificate chained to `client_ca` fails the handshake, before
//!   it can send or read one xDS byte (the listener hands tonic only finished handshakes);
//! - a reload that fails (a file missing, half written, unparsable, not a regular file, a
//!   key that is not the certificate's, a server certificate expired or not yet valid, a
//!   "CA" that is no CA) changes nothing: the last good configuration goes on serving,
//!   and each distinct failure is logged and counted once;
//! - a reload applies to handshakes that start after it: connections already open keep
//!   their session, so a rotation never drops a stream.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;

/// The PEM files of `xds.tls`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain presented, the server's first.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CAs whose client certificates are accepted.
    pub client_ca: PathBuf,
}

/// The largest PEM file read (a chain of a few certificates is a few KiB).
const MAX_PEM_BYTES: u64 = 1024 * 1024;

/// How often the files are compared with what was loaded. Kubernetes updates a mounted
/// Secret by swapping a symlink, which file-change notifications miss; reading three
/// small files every few seconds cannot miss it.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// Why the files did not make a configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {file}: {source}")]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: {message}")]
    Pem { file: PathBuf, message: String },
    #[error("{0}")]
    Config(String),
}

/// How far in the future a server certificate's `notBefore` may be (clocks differ a
/// little between the issuer and this node).
pub(crate) const NOT_BEFORE_SKEW: Duration = Duration::from_secs(300);

/// The server's TLS configuration, swapped whole on a good reload.
pub struct ServerTls {
    files: TlsFiles,
    current: ArcSwap<ServerConfig>,
    /// A digest of the three files' bytes that made `current`: files equal to them are
    /// unchanged. (Files that failed are tried again at each tick: a certificate not yet
    /// valid becomes valid without its bytes changing.)
    serving: Mutex<[u8; 32]>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

/// What [`ServerTls::reload_if_changed`] did.
#[derive(Debug)]
pub(crate) enum Reload {
    /// The files are as last read.
    Unchanged,
    /// A new configuration serves new handshakes.
    Reloaded,
    /// The files changed but make no configuration; the last good one goes on.
    Failed(TlsError),
}

impl ServerTls {
    /// Reads the files; an error here is fatal at start (there is no last good state).
    pub fn load(files: TlsFiles) -> Result<Arc<ServerTls>, TlsError> {
        let bytes = read_all(&files)?;
        let config = server_config(&files, &bytes, SystemTime::now())?;
        Ok(Arc::new(ServerTls {
            current: ArcSwap::from_pointee(config),
            serving: Mutex::new(digest(&bytes)),
            files,
        }))
    }

    /// An acceptor with the configuration of this moment.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.load_full())
    }

    /// Reads the files again and, if they changed and make a configuration, serves it.
    pub(crate) fn reload_if_changed(&self) -> Reload {
        let bytes = match read_all(&self.files) {
            Ok(bytes) => bytes,
            // A file missing for a moment (a Secret being swapped) is a failure only if
            // it lasts: the next tick tries again, and nothing is marked seen.
            Err(e) => return Reload::Failed(e),
        };
        let sum = digest(&bytes);
        let mut serving = self.serving.lock().unwrap_or_else(|e| e.into_inner());
        if *serving == sum {
            return Reload::Unchanged;
        }
        match server_config(&self.files, &bytes, SystemTime::now()) {
            Ok(config) => {
                self.current.store(Arc::new(config));
                *serving = sum;
                Reload::Reloaded
            }
            Err(e) => Reload::Failed(e),
        }
    }
}

/// Compares the files with what was loaded every [`RELOAD_INTERVAL`] until `shutdown`;
/// logs and reports each reload and each failure (once per change of the files).
pub async fn watch(
    tls: Arc<ServerTls>,
    interval: Duration,
    observer: Arc<dyn super::Observer>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    // The failure last reported: the same one again at the next tick is not news; a
    // different one is.
    let mut failing: Option<String> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let tls = tls.clone();
        let Ok(outcome) = tokio::task::spawn_blocking(move || tls.reload_if_changed()).await else {
            continue;
        };
        match outcome {
            Reload::Unchanged => failing = None,
            Reload::Reloaded => {
                failing = None;
                observer.tls_reload(true);
                tracing::info!("xDS TLS: certificate files changed; new handshakes use them");
            }
            Reload::Failed(e) => {
                let message = e.to_string();
                if failing.as_ref() != Some(&message) {
                    observer.tls_reload(false);
                    tracing::warn!(error = %message, "xDS TLS: certificate files changed but cannot be used; keeping the last good ones");
                    failing = Some(message);
                }
            }
        }
    }
}

fn read_all(files: &TlsFiles) -> Result<[Vec<u8>; 3], TlsError> {
    Ok([
        read_pem(&files.cert)?,
        read_pem(&files.key)?,
        read_pem(&files.client_ca)?,
    ])
}

fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let read = |source| TlsError::Read {
        file: path.to_path_buf(),
        source,
    };
    // Non-blocking: opening a FIFO put where a certificate was would otherwise wait for
    // a writer for ever, and the reloads with it.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(read)?;
    if !file.metadata().map_err(read)?.is_file() {
        return Err(TlsError::Pem {
            file: path.to_path_buf(),
            message: "not a regular file".into(),
        });
    }
    let mut bytes = Vec::new();
    file.take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(TlsError::Pem {
            file: path.to_path_buf(),
            message: format!("over {} MiB: not a PEM file", MAX_PEM_BYTES >> 20),
        });
    }
    Ok(bytes)
}

fn digest(bytes: &[Vec<u8>; 3]) -> [u8; 32] {
    let mut hash = Sha256::new();
    for b in bytes {
        hash.update((b.len() as u64).to_le_bytes());
        hash.update(b);
    }
    hash.finalize().into()
}

fn pem_error(file: &Path, message: impl std::fmt::Display) -> TlsError {
    TlsError::Pem {
        file: file.to_path_buf(),
        message: message.to_string(),
    }
}

fn certificates(file: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(file, format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(pem_error(file, "no CERTIFICATE block"));
    }
    Ok(certs)
}

/// Whether the server certificate `der` is valid at `now`: not expired, and valid from no
/// later than [`NOT_BEFORE_SKEW`] ahead.
fn check_validity(file: &Path, der: &CertificateDer<'_>, now: SystemTime) -> Result<(), TlsError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| pem_error(file, format!("the first certificate does not parse: {e}")))?;
    let now = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let validity = cert.validity();
    if validity.not_after.timestamp() < now {
        return Err(pem_error(
            file,
            format!("the certificate expired at {}", validity.not_after),
        ));
    }
    if validity.not_before.timestamp() > now + NOT_BEFORE_SKEW.as_secs() as i64 {
        return Err(pem_error(
            file,
            format!(
                "the certificate is not valid before {}",
                validity.not_before
            ),
        ));
    }
    Ok(())
}

/// A trust anchor must be a CA: a leaf here would let whoever has its key mint client
/// certificates (webpki does not look at an anchor's basic constraints).
fn check_ca(file: &Path, der: &CertificateDer<'_>) -> Result<(), TlsError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| pem_error(file, format!("a certificate does not parse: {e}")))?;
    if cert.is_ca() {
        Ok(())
    } else {
        Err(pem_error(
            file,
            format!(
                "{} is not a CA certificate (no basicConstraints CA:TRUE): client_ca holds the CAs that sign client certificates",
                cert.subject()
            ),
        ))
    }
}

/// The configuration the three files make at `now`: TLS 1.2 and 1.3, ALPN `h2` (gRPC),
/// and a client certificate required and verified against `client_ca` (its CA
/// certificates, and the CRLs it holds beside them: a revoked client certificate is
/// refused).
fn server_config(
    files: &TlsFiles,
    [cert, key, ca]: &[Vec<u8>; 3],
    now: SystemTime,
) -> Result<ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certificates(&files.cert, cert)?;
    check_validity(&files.cert, &chain[0], now)?;
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| pem_error(&files.key, format!("no usable private key: {e}")))?;
    let mut roots = RootCertStore::empty();
    for ca_cert in certificates(&files.client_ca, ca)? {
        check_ca(&files.client_ca, &ca_cert)?;
        roots
            .add(ca_cert)
            .map_err(|e| pem_error(&files.client_ca, format!("not a CA certificate: {e}")))?;
    }
    let crls = CertificateRevocationListDer::pem_slice_iter(ca)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(&files.client_ca, format!("a CRL does not parse: {e}")))?;
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .with_crls(crls)
        // A CRL covers the client certificates of its own CA; a chain through another
        // CA without one is not refused for that.
        .only_check_end_entity_revocation()
        .allow_unknown_revocation_status()
        .build()
        .map_err(|e| pem_error(&files.client_ca, e))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| {
            TlsError::Config(format!(
                "{} and {}: {e}",
                files.cert.display(),
                files.key.display()
            ))
        })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

    struct Files {
        _dir: tempfile::TempDir,
        files: TlsFiles,
        ca: CertifiedIssuer<'static, KeyPair>,
    }

    fn ca() -> CertifiedIssuer<'static, KeyPair> {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
    }

    fn leaf(ca: &CertifiedIssuer<'static, KeyPair>) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&key, ca)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn files() -> Files {
        let dir = tempfile::tempdir().unwrap();
        let files = TlsFiles {
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
            client_ca: dir.path().join("ca.crt"),
        };
        let ca = ca();
        let (cert, key) = leaf(&ca);
        std::fs::write(&files.cert, cert).unwrap();
        std::fs::write(&files.key, key).unwrap();
        std::fs::write(&files.client_ca, ca.pem()).unwrap();
        Files {
            _dir: dir,
            files,
            ca,
        }
    }

    fn served(tls: &ServerTls) -> Arc<ServerConfig> {
        tls.current.load_full()
    }

    #[test]
    fn loads_and_serves_h2_with_client_certificates_required() {
        let f = files();
        let tls = ServerTls::load(f.files.clone()).unwrap();
        let config = served(&tls);
        assert_eq!(config.alpn_protocols, vec![b"h2".to_vec()]);
        assert!(matches!(tls.reload_if_changed(), Reload::Unchanged));
    }

    /// A handshake between `tls`'s acceptor and a client trusting `f.ca`, presenting
    /// `client` (certificate and key PEM) if any; then one byte each way, which is where
    /// TLS 1.3 clients learn that the server refused their certificate.
    async fn handshake(
        tls: &ServerTls,
        ca: &str,
        client: Option<(String, String)>,
    ) -> Result<(), String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.as_bytes()).unwrap())
            .unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match client {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                    PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let acceptor = tls.acceptor();
        let server = tokio::spawn(async move {
            let mut s = acceptor
                .accept(server_io)
                .await
                .map_err(|e| e.to_string())?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b).await.map_err(|e| e.to_string())?;
            s.write_all(&b).await.map_err(|e| e.to_string())?;
            s.flush().await.map_err(|e| e.to_string())
        });
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let client = async {
            let mut c = connector
                .connect(name, client_io)
                .await
                .map_err(|e| e.to_string())?;
            c.write_all(b"x").await.map_err(|e| e.to_string())?;
            c.flush().await.map_err(|e| e.to_string())?;
            let mut b = [0u8; 1];
            c.read_exact(&mut b).await.map_err(|e| e.to_string())
        };
        let client = client.await;
        let server = server.await.unwrap();
        client
            .and(server.map_err(|e| format!("server: {e}")))
            .map(|_| ())
    }

    #[tokio::test]
    async fn only_a_client_certificate_the_client_ca_signed_gets_through() {
        let f = files();
        let tls = ServerTls::load(f.files.clone()).unwrap();
        let ca = f.ca.pem();
        handshake(&tls, &ca, Some(leaf(&f.ca)))
            .await
            .expect("a client the CA signed");
        let e = handshake(&tls, &ca, None).await.unwrap_err();
        assert!(
            e.contains("CertificateRequired") || e.contains("certificate"),
            "{e}"
        );
        // Another CA (named alike, as rcgen names them all: its signature is what fails).
        let stranger = super::tests::ca();
        handshake(&tls, &ca, Some(leaf(&stranger)))
            .await
            .unwrap_err();
    }

    #[test]
    fn errors_name_the_file_and_what_is_wrong() {
        let f = files();
        let mut missing = f.files.clone();
        missing.key = f.files.key.with_extension("gone");
        let e = ServerTls::load(missing).unwrap_err().to_string();
        assert!(e.contains("tls.gone") && e.contains("reading"), "{e}");

        std::fs::write(&f.files.client_ca, "not a certificate\n").unwrap();
        let e = ServerTls::load(f.files.clone()).unwrap_err().to_string();
        assert!(e.contains("ca.crt") && e.contains("no CERTIFICATE"), "{e}");

        // A key that is not the certificate's.
        std::fs::write(&f.files.client_ca, f.ca.pem()).unwrap();
        let (_, other_key) = leaf(&f.ca);
        std::fs::write(&f.files.key, other_key).unwrap();
        let e = ServerTls::load(f.files.clone()).unwrap_err().to_string();
        assert!(e.contains("tls.crt and") && e.contains("tls.key"), "{e}");

        std::fs::write(&f.files.key, "").unwrap();
        let e = ServerTls::load(f.files.clone()).unwrap_err().to_string();
        assert!(e.contains("no usable private key"), "{e}");

        std::fs::write(&f.files.cert, vec![b'x'; (MAX_PEM_BYTES + 1) as usize]).unwrap();
        let e = ServerTls::load(f.files.clone()).unwrap_err().to_string();
        assert!(e.contains("not a PEM file"), "{e}");
    }

    #[test]
    fn a_good_change_is_served_and_a_bad_one_keeps_the_last_good_configuration() {
        let f = files();
        let tls = ServerTls::load(f.files.clone()).unwrap();
        let first = served(&tls);

        // A new certificate and key: reloaded once, then unchanged.
        let (cert, key) = leaf(&f.ca);
        std::fs::write(&f.files.cert, cert).unwrap();
        std::fs::write(&f.files.key, key).unwrap();
        assert!(matches!(tls.reload_if_changed(), Reload::Reloaded));
        let second = served(&tls);
        assert!(!Arc::ptr_eq(&first, &second));
        assert!(matches!(tls.reload_if_changed(), Reload::Unchanged));

        // Half a rotation: a new certificate whose key has not arrived yet.
        let (cert, next_key) = leaf(&f.ca);
        std::fs::write(&f.files.cert, cert).unwrap();
        assert!(matches!(tls.reload_if_changed(), Reload::Failed(_)));
        assert!(
            Arc::ptr_eq(&second, &served(&tls)),
            "a failed reload changed nothing"
        );
        // Tried again at each tick (the watcher reports each distinct failure once).
        assert!(matches!(tls.reload_if_changed(), Reload::Failed(_)));
        // The key arrives: the pair is served.
        std::fs::write(&f.files.key, next_key).unwrap();
        assert!(matches!(tls.reload_if_changed(), Reload::Reloaded));

        // A file gone for a moment (a Secret's symlink being swapped) fails, keeps the
        // configuration, and is tried again when it is back.
        let third = served(&tls);
        std::fs::remove_file(&f.files.client_ca).unwrap();
        assert!(matches!(
            tls.reload_if_changed(),
            Reload::Failed(TlsError::Read { .. })
        ));
        assert!(Arc::ptr_eq(&third, &served(&tls)));
        std::fs::write(&f.files.client_ca, f.ca.pem()).unwrap();
        assert!(matches!(tls.reload_if_changed(), Reload::Unchanged));

        // A FIFO where the certificate was: refused at once, not waited on.
        std::fs::remove_file(&f.files.cert).unwrap();
        let fifo = std::ffi::CString::new(f.files.cert.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let e = match tls.reload_if_changed() {
            Reload::Failed(e) => e.to_string(),
            other => panic!("{other:?}"),
        };
        assert!(e.contains("not a regular file"), "{e}");
        assert!(Arc::ptr_eq(&third, &served(&tls)));
    }

    #[test]
    fn an_expired_or_future_server_certificate_is_not_served() {
        let f = files();
        let tls = ServerTls::load(f.files.clone()).unwrap();
        let serving = served(&tls);
        let dated = |not_before: (i32, u8, u8), not_after: (i32, u8, u8)| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
            params.not_before = rcgen::date_time_ymd(not_before.0, not_before.1, not_before.2);
            params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
            let cert = params.signed_by(&key, &f.ca).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        for ((cert, key), why) in [
            (dated((2000, 1, 1), (2001, 1, 1)), "expired"),
            (dated((2999, 1, 1), (3000, 1, 1)), "not valid before"),
        ] {
            std::fs::write(&f.files.cert, &cert).unwrap();
            std::fs::write(&f.files.key, &key).unwrap();
            let e = match tls.reload_if_changed() {
                Reload::Failed(e) => e.to_string(),
                other => panic!("{other:?}"),
            };
            assert!(e.contains(why) && e.contains("tls.crt"), "{e}");
            assert!(Arc::ptr_eq(&serving, &served(&tls)));
            // At start: refused too, naming the file.
            let e = ServerTls::load(f.files.clone()).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn a_client_ca_file_must_hold_cas() {
        let f = files();
        let (leaf_cert, _) = leaf(&f.ca);
        std::fs::write(&f.files.client_ca, &leaf_cert).unwrap();
        let e = ServerTls::load(f.files.clone()).unwrap_err().to_string();
        assert!(
            e.contains("ca.crt") && e.contains("not a CA certificate"),
            "{e}"
        );
    }
}
