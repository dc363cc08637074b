//! Certificates made in tests: a CA, a server certificate for ray-xds's xDS listener and a
//! client certificate for Envoy, written as PEM files into a folder of the test's.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// The names the server certificate carries (the Kubernetes Service's, and loopback's).
pub const SERVER_NAMES: [&str; 4] = [
    "localhost",
    "127.0.0.1",
    "ray-xds.ray-xds.svc",
    "ray-xds.ray-xds.svc.cluster.local",
];

/// A CA and what it signed, as files.
pub struct TestPki {
    pub dir: PathBuf,
    pub ca_pem_path: PathBuf,
    pub server_cert_path: PathBuf,
    pub server_key_path: PathBuf,
    pub client_cert_path: PathBuf,
    pub client_key_path: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl TestPki {
    /// A new CA (its own key) with a server and a client certificate, under `dir`.
    pub fn new(dir: &Path) -> TestPki {
        std::fs::create_dir_all(dir).unwrap();
        let ca = new_ca("ray-xds test CA");
        let pki = TestPki {
            dir: dir.to_path_buf(),
            ca_pem_path: dir.join("ca.crt"),
            server_cert_path: dir.join("server.crt"),
            server_key_path: dir.join("server.key"),
            client_cert_path: dir.join("client.crt"),
            client_key_path: dir.join("client.key"),
            ca,
        };
        std::fs::write(&pki.ca_pem_path, pki.ca.pem()).unwrap();
        pki.issue_server(&pki.server_cert_path, &pki.server_key_path);
        let (cert, key) = pki.client_pem("envoy-gateway");
        std::fs::write(&pki.client_cert_path, cert).unwrap();
        std::fs::write(&pki.client_key_path, key).unwrap();
        pki
    }

    /// A new server certificate and key (a new key pair) from the same CA, written to
    /// `cert` and `key` (each atomically, as a Secret's files are swapped).
    pub fn issue_server(&self, cert: &Path, key: &Path) -> String {
        let (pem, key_pem) = self.leaf(
            "ray-xds",
            SERVER_NAMES.iter().map(|s| s.to_string()).collect(),
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        write_atomic(key, &key_pem);
        write_atomic(cert, &pem);
        pem
    }

    /// A server certificate for `key_pem` (a private key in PEM, of any type rcgen
    /// signs with: an RSA key made by openssl, say), written to `cert` and `key`.
    pub fn issue_server_for_key(&self, cert: &Path, key: &Path, key_pem: &str) {
        let pair = KeyPair::from_pem(key_pem).expect("a private key rcgen reads");
        let (pem, key_pem) = self.leaf_with(
            Some(pair),
            "ray-xds",
            SERVER_NAMES.iter().map(|s| s.to_string()).collect(),
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        write_atomic(key, &key_pem);
        write_atomic(cert, &pem);
    }

    /// A client certificate and key (PEM) signed by this CA.
    pub fn client_pem(&self, name: &str) -> (String, String) {
        self.leaf(
            name,
            vec![format!("{name}.example")],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    fn leaf(
        &self,
        common_name: &str,
        names: Vec<String>,
        usage: ExtendedKeyUsagePurpose,
    ) -> (String, String) {
        self.leaf_with(None, common_name, names, usage)
    }

    /// A leaf for `key`, or a new ECDSA P-256 key.
    fn leaf_with(
        &self,
        key: Option<KeyPair>,
        common_name: &str,
        names: Vec<String>,
        usage: ExtendedKeyUsagePurpose,
    ) -> (String, String) {
        let key = key.unwrap_or_else(|| KeyPair::generate().unwrap());
        let mut params = CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![usage];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let cert = params.signed_by(&key, &self.ca).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A rustls client trusting `trust` (PEM CAs), presenting `identity` (a PEM chain and
/// its key) if any, offering `alpn`.
pub fn client_config(
    trust: &str,
    identity: Option<(&str, &str)>,
    alpn: &[&[u8]],
) -> rustls::ClientConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(trust.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(cert.as_bytes())
                    .map(|c| c.unwrap())
                    .collect(),
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config
}

/// Another CA's client certificate and key (PEM): well formed, trusted by nobody here.
pub fn foreign_client_pem() -> (String, String) {
    let ca = new_ca("someone else's CA");
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["intruder.example".to_string()]).unwrap();
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, &ca).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn new_ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Writes `hello` (an HTTP/2 client preface, and perhaps frames after it) on `stream` and
/// reads the first frame's header back: `Ok` when it is a SETTINGS frame, as an HTTP/2
/// server's first frame is.
pub async fn first_frame_is_settings<S>(stream: &mut S, hello: &[u8]) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    stream
        .write_all(hello)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut frame = [0u8; 9];
    stream
        .read_exact(&mut frame)
        .await
        .map_err(|e| format!("read: {e}"))?;
    if frame[3] == 4 {
        Ok(())
    } else {
        Err(format!("not a SETTINGS frame: {frame:?}"))
    }
}
