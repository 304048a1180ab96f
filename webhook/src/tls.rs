//! TLS serving configuration whose certificate follows the files on disk.
//!
//! In: the paths of a PEM certificate chain and a PEM private key. Out: a rustls
//! `ServerConfig` whose certificate resolver looks at both files' metadata (mtime, size,
//! inode) on every handshake and re-parses them only when that changed, so a rotated
//! certificate (cert-manager, a kubelet Secret volume's symlink swap, `mv` over the file) is
//! served from the next connection on, without a restart. The same design as kubert's
//! server: the parsed key is cached and a stat pair per handshake is the whole cost.
//!
//! A half-written rotation (new certificate, old key, or a truncated file) fails to parse or
//! fails the key/certificate match; the previous pair then stays in service and the files
//! are tried again on the next handshake.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// Why a certificate/key pair could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The certificate file has no `CERTIFICATE` PEM block (or a broken one).
    #[error("{0}: no PEM certificate found")]
    NoCertificate(PathBuf),
    /// The key file has no PKCS#8, PKCS#1 or SEC1 private key PEM block.
    #[error("{0}: no PEM private key found")]
    NoKey(PathBuf),
    /// rustls rejected the key, or it does not belong to the certificate.
    #[error("certificate {cert} and key {key} are unusable together: {source}")]
    Unusable {
        /// Certificate path.
        cert: PathBuf,
        /// Key path.
        key: PathBuf,
        /// rustls's reason.
        source: rustls::Error,
    },
}

/// What identifies one version of a file without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    ino: u64,
    dev: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    // `metadata` follows symlinks, so a Secret volume's `..data` swap changes the inode.
    let m = fs::metadata(path).ok()?;
    Some(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
        ino: m.ino(),
        dev: m.dev(),
    })
}

/// Loads and checks a certificate chain and its key.
pub fn load_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let read = |p: &Path| {
        fs::read(p).map_err(|source| TlsError::Read {
            path: p.to_path_buf(),
            source,
        })
    };
    let cert_pem = read(cert)?;
    let key_pem = read(key)?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| TlsError::NoCertificate(cert.to_path_buf()))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate(cert.to_path_buf()));
    }
    let der =
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NoKey(key.to_path_buf()))?;
    let unusable = |source| TlsError::Unusable {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        source,
    };
    let provider = rustls::crypto::ring::default_provider();
    let certified = CertifiedKey::from_der(chain, der, &provider).map_err(unusable)?;
    Ok(certified)
}

type Stamps = (Option<Stamp>, Option<Stamp>);

struct Loaded {
    /// The files' stamps when `key` was loaded from them.
    stamps: Stamps,
    key: Arc<CertifiedKey>,
    /// Stamps of a version that failed to load: not retried (nor logged) until it changes.
    failed: Option<Stamps>,
}

/// A `ResolvesServerCert` that re-reads the files when they change.
pub struct ReloadingResolver {
    cert: PathBuf,
    key: PathBuf,
    loaded: Mutex<Loaded>,
}

impl std::fmt::Debug for ReloadingResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadingResolver")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl ReloadingResolver {
    /// Loads the pair once; fails when the files are not usable now, so a misconfigured
    /// webhook refuses to start rather than failing every handshake.
    pub fn new(cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Result<Self, TlsError> {
        let (cert, key) = (cert.into(), key.into());
        let stamps = (stamp(&cert), stamp(&key));
        let loaded = load_pair(&cert, &key)?;
        Ok(Self {
            cert,
            key,
            loaded: Mutex::new(Loaded {
                stamps,
                key: Arc::new(loaded),
                failed: None,
            }),
        })
    }

    /// The pair to serve now, reloading it first when either file changed.
    pub fn current(&self) -> Arc<CertifiedKey> {
        let stamps = (stamp(&self.cert), stamp(&self.key));
        // A poisoned lock only means another handshake panicked mid-reload; the cached pair
        // is still a whole value, so keep serving it.
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if loaded.stamps != stamps && loaded.failed != Some(stamps) {
            match load_pair(&self.cert, &self.key) {
                Ok(k) => {
                    tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                    *loaded = Loaded {
                        stamps,
                        key: Arc::new(k),
                        failed: None,
                    };
                }
                Err(e) => {
                    tracing::warn!(error = %e, "certificate files changed but cannot be loaded yet; serving the previous pair");
                    loaded.failed = Some(stamps);
                }
            }
        }
        loaded.key.clone()
    }
}

impl ResolvesServerCert for ReloadingResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A rustls server config (TLS 1.2 and 1.3, HTTP/1.1 ALPN) backed by a [`ReloadingResolver`].
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let resolver = ReloadingResolver::new(cert, key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Unusable {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            source,
        })?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `data` and gives the file a fresh, distinct mtime: the kernel's timestamps are
    /// coarse (a few ms), and two writes of same-sized PEM files within one tick would look
    /// identical, which a real rotation (minutes apart) never does.
    fn write(path: &Path, data: &[u8]) {
        use std::sync::atomic::{AtomicU64, Ordering};
        static TICK: AtomicU64 = AtomicU64::new(1);
        fs::write(path, data).unwrap();
        let t = SystemTime::UNIX_EPOCH
            + std::time::Duration::from_secs(1_000_000 + TICK.fetch_add(1, Ordering::Relaxed));
        fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(t)
            .unwrap();
    }

    fn write_pair(dir: &Path, cn: &str) -> (PathBuf, PathBuf, Vec<u8>) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec![cn.to_string()]).unwrap();
        let cert = params.self_signed(&key).unwrap();
        let (c, k) = (dir.join("tls.crt"), dir.join("tls.key"));
        write(&c, cert.pem().as_bytes());
        write(&k, key.serialize_pem().as_bytes());
        (c, k, cert.der().to_vec())
    }

    #[test]
    fn reloads_when_the_files_change_and_keeps_the_old_pair_on_a_broken_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let (c, k, der1) = write_pair(dir.path(), "one.test");
        let r = ReloadingResolver::new(&c, &k).unwrap();
        assert_eq!(r.current().cert[0].as_ref(), der1.as_slice());

        // Half-done rotation: a new certificate next to the old key is refused.
        let old_key = fs::read(&k).unwrap();
        let (_, _, der2) = write_pair(dir.path(), "two.test");
        let new_key = fs::read(&k).unwrap();
        write(&k, &old_key);
        assert_eq!(r.current().cert[0].as_ref(), der1.as_slice());
        assert_eq!(r.current().cert[0].as_ref(), der1.as_slice());

        // Rotation completes: the next handshake serves the new pair.
        write(&k, &new_key);
        assert_eq!(r.current().cert[0].as_ref(), der2.as_slice());

        // A truncated file keeps the current pair in service.
        write(&c, b"-----BEGIN CERTIFICATE-----\nAAAA");
        assert_eq!(r.current().cert[0].as_ref(), der2.as_slice());
    }

    #[test]
    fn startup_fails_on_unusable_files() {
        let dir = tempfile::tempdir().unwrap();
        let (c, k, _) = write_pair(dir.path(), "one.test");
        assert!(matches!(
            ReloadingResolver::new(dir.path().join("missing"), &k),
            Err(TlsError::Read { .. })
        ));
        fs::write(dir.path().join("empty"), b"").unwrap();
        assert!(matches!(
            ReloadingResolver::new(&c, dir.path().join("empty")),
            Err(TlsError::NoKey(_))
        ));
        assert!(matches!(
            ReloadingResolver::new(dir.path().join("empty"), &k),
            Err(TlsError::NoCertificate(_))
        ));
    }
}
