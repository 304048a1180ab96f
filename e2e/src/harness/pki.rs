//! The control plane's keys and certificates, generated in Rust with rcgen (no openssl CLI).
//!
//! In: a directory. Out: PEM files in it, and the CA certificate in memory so clients can trust
//! the servers. One throwaway CA signs everything: the apiserver's serving certificate, the
//! controller manager's and scheduler's serving certificates, and client certificates whose
//! subject is the Kubernetes identity (CN = user, O = group) that the apiserver's x509
//! authenticator reads. The service-account signing key is separate from the CA, as in a real
//! cluster. All keys are ECDSA P-256: rcgen's ring backend cannot generate RSA keys, and every
//! component accepts EC keys for TLS and for ES256 service-account tokens.

use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::Error;

/// The ClusterIP of the `kubernetes` Service: the first address of the service range the
/// apiserver is started with. In-cluster clients dial it, so the serving cert names it.
pub(crate) const SERVICE_CIDR: &str = "10.0.0.0/24";
const KUBERNETES_SERVICE_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));

/// A certificate and its key on disk.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// PEM certificate.
    pub cert: PathBuf,
    /// PEM PKCS#8 private key (mode 0600).
    pub key: PathBuf,
}

/// Every key and certificate file the control plane is started with.
#[derive(Debug, Clone)]
pub struct Pki {
    /// The CA certificate (PEM), trusted by every client and used as `--client-ca-file`.
    pub ca_cert: PathBuf,
    /// The CA certificate in DER, for in-process clients.
    pub ca_der: Vec<u8>,
    /// The CA certificate in PEM.
    pub ca_pem: String,
    /// The CA's private key (PKCS#8 PEM, mode 0600), kept so the real node's kubelet can get
    /// a client certificate of its own ([`Pki::issue_client`]) after the control plane started.
    pub ca_key: PathBuf,
    /// CA for request-header (front proxy) authentication.
    pub front_proxy_ca: PathBuf,
    /// The apiserver's client certificate towards aggregated API servers.
    pub front_proxy_client: CertFiles,
    /// kube-apiserver's serving certificate (127.0.0.1, localhost, kubernetes.default.svc, ...).
    pub apiserver: CertFiles,
    /// kube-controller-manager's serving certificate (127.0.0.1).
    pub controller_manager_serving: CertFiles,
    /// kube-scheduler's serving certificate (127.0.0.1).
    pub scheduler_serving: CertFiles,
    /// Client certificate for `admin`, group `system:masters`.
    pub admin: CertFiles,
    /// Client certificate for `system:kube-controller-manager`.
    pub controller_manager: CertFiles,
    /// Client certificate for `system:kube-scheduler`.
    pub scheduler: CertFiles,
    /// Service-account token signing key (private, PKCS#8 PEM).
    pub service_account_key: PathBuf,
    /// Its public half, for `--service-account-key-file`.
    pub service_account_pub: PathBuf,
}

impl Pki {
    /// Generates a fresh CA and every certificate into `dir` (created if missing). The
    /// apiserver's serving certificate also names `extra_ips` (the address a routable control
    /// plane binds, see `control_plane::Options::routable`).
    pub fn generate(dir: &Path, extra_ips: &[IpAddr]) -> Result<Self, Error> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;

        let (ca, ca_cert) = new_ca(CA_NAME)?;
        let ca_pem = ca_cert.pem();
        let ca_path = dir.join("ca.crt");
        write(&ca_path, ca_pem.as_bytes(), 0o644)?;
        let ca_key = dir.join("ca.key");
        write(&ca_key, ca.key().serialize_pem().as_bytes(), 0o600)?;
        let (front_proxy_ca, front_proxy_client) = front_proxy(dir)?;

        let serving = |stem, name, sans| leaf(&ca, dir, stem, name, None, sans, Usage::Server);
        let apiserver = serving("apiserver", "kube-apiserver", apiserver_sans(extra_ips))?;
        let controller_manager_serving = serving(
            "controller-manager-serving",
            "kube-controller-manager",
            loopback(),
        )?;
        let scheduler_serving = serving("scheduler-serving", "kube-scheduler", loopback())?;
        let client = |stem, name, group| leaf(&ca, dir, stem, name, group, vec![], Usage::Client);
        let admin = client("admin", "admin", Some("system:masters"))?;
        let controller_manager =
            client("controller-manager", "system:kube-controller-manager", None)?;
        let scheduler = client("scheduler", "system:kube-scheduler", None)?;
        let (service_account_key, service_account_pub) = service_account(dir)?;

        Ok(Self {
            ca_cert: ca_path,
            ca_der: ca_cert.der().to_vec(),
            ca_pem,
            ca_key,
            front_proxy_ca,
            front_proxy_client,
            apiserver,
            controller_manager_serving,
            scheduler_serving,
            admin,
            controller_manager,
            scheduler,
            service_account_key,
            service_account_pub,
        })
    }
}

impl Pki {
    /// Issues a client certificate (CN = `user`, O = `group`) from the control plane's CA into
    /// `dir`, named `<file_stem>.crt` / `.key`. The real node's kubelet gets
    /// `system:node:<name>` in `system:nodes` this way, the identity the Node authorizer and
    /// NodeRestriction admit.
    pub fn issue_client(
        &self,
        dir: &Path,
        file_stem: &str,
        user: &str,
        group: Option<&str>,
    ) -> Result<CertFiles, Error> {
        let what = "the CA key";
        let pem = std::fs::read_to_string(&self.ca_key)
            .map_err(|e| Error::io(format!("reading {}", self.ca_key.display()), e))?;
        let key = KeyPair::from_pem(&pem).map_err(cert_err(what))?;
        // The issuer is named by the CA's distinguished name and identified by its key; both
        // are the same as at generation, so the new leaf chains to the CA certificate on disk.
        let issuer = Issuer::new(ca_params(CA_NAME), key);
        leaf(
            &issuer,
            dir,
            file_stem,
            user,
            group,
            Vec::new(),
            Usage::Client,
        )
    }
}

/// A separate CA for the aggregation layer's request-header authentication, as kubeadm does: a
/// client certificate from the main CA must never be able to assert X-Remote-User. The
/// controller manager and scheduler read it from the extension-apiserver-authentication
/// ConfigMap and complain while it is missing. Returns the CA's certificate file and the
/// apiserver's client certificate it signs.
fn front_proxy(dir: &Path) -> Result<(PathBuf, CertFiles), Error> {
    let (front_proxy, front_proxy_cert) = new_ca("meshgate-e2e-front-proxy-ca")?;
    let front_proxy_ca = dir.join("front-proxy-ca.crt");
    write(&front_proxy_ca, front_proxy_cert.pem().as_bytes(), 0o644)?;
    let front_proxy_client = leaf(
        &front_proxy,
        dir,
        "front-proxy-client",
        FRONT_PROXY_CLIENT,
        None,
        Vec::new(),
        Usage::Client,
    )?;
    Ok((front_proxy_ca, front_proxy_client))
}

/// The names every serving certificate carries: 127.0.0.1 and `localhost`.
fn loopback() -> Vec<SanType> {
    vec![
        SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        dns("localhost"),
    ]
}

/// The apiserver's names: loopback, the `kubernetes` Service's ClusterIP and DNS names, and
/// `extra_ips`.
fn apiserver_sans(extra_ips: &[IpAddr]) -> Vec<SanType> {
    let mut sans = loopback();
    sans.push(SanType::IpAddress(KUBERNETES_SERVICE_IP));
    sans.extend(extra_ips.iter().copied().map(SanType::IpAddress));
    for name in [
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ] {
        sans.push(dns(name));
    }
    sans
}

/// The service-account signing key pair, apart from the CA as in a real cluster: (private key,
/// public key) files.
fn service_account(dir: &Path) -> Result<(PathBuf, PathBuf), Error> {
    let sa_key = key("the service-account signing key")?;
    let service_account_key = dir.join("sa.key");
    let service_account_pub = dir.join("sa.pub");
    write(
        &service_account_key,
        sa_key.serialize_pem().as_bytes(),
        0o600,
    )?;
    write(
        &service_account_pub,
        sa_key.public_key_pem().as_bytes(),
        0o644,
    )?;
    Ok((service_account_key, service_account_pub))
}

/// Common name of the control plane's CA.
const CA_NAME: &str = "meshgate-e2e-ca";

/// Common name of the front-proxy client certificate (`--requestheader-allowed-names`).
pub(crate) const FRONT_PROXY_CLIENT: &str = "front-proxy-client";

fn new_ca(common_name: &str) -> Result<(Issuer<'static, KeyPair>, rcgen::Certificate), Error> {
    let what = format!("the {common_name} certificate");
    let ca_key = key(&what)?;
    let params = ca_params(common_name);
    let cert = params.self_signed(&ca_key).map_err(cert_err(&what))?;
    Ok((Issuer::new(params, ca_key), cert))
}

fn ca_params(common_name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

enum Usage {
    Server,
    Client,
}

fn leaf(
    ca: &Issuer<'static, KeyPair>,
    dir: &Path,
    file_stem: &str,
    common_name: &str,
    organization: Option<&str>,
    sans: Vec<SanType>,
    usage: Usage,
) -> Result<CertFiles, Error> {
    let what = format!("the {file_stem} certificate");
    let key = key(&what)?;
    let mut p = CertificateParams::default();
    p.subject_alt_names = sans;
    p.distinguished_name.push(DnType::CommonName, common_name);
    if let Some(org) = organization {
        p.distinguished_name.push(DnType::OrganizationName, org);
    }
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![match usage {
        Usage::Server => ExtendedKeyUsagePurpose::ServerAuth,
        Usage::Client => ExtendedKeyUsagePurpose::ClientAuth,
    }];
    p.use_authority_key_identifier_extension = true;
    let cert = p.signed_by(&key, ca).map_err(cert_err(&what))?;
    let files = CertFiles {
        cert: dir.join(format!("{file_stem}.crt")),
        key: dir.join(format!("{file_stem}.key")),
    };
    write(&files.cert, cert.pem().as_bytes(), 0o644)?;
    write(&files.key, key.serialize_pem().as_bytes(), 0o600)?;
    Ok(files)
}

fn key(what: &str) -> Result<KeyPair, Error> {
    KeyPair::generate().map_err(cert_err(what))
}

fn dns(name: &str) -> SanType {
    // Only called with the fixed, valid names above; an invalid one would be a programming error
    // caught by the unit test, so fall back to the IP form rather than panic.
    name.to_owned()
        .try_into()
        .map(SanType::DnsName)
        .unwrap_or(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

fn cert_err(what: &str) -> impl FnOnce(rcgen::Error) -> Error + '_ {
    move |source| Error::Cert {
        what: what.to_owned(),
        source,
    }
}

fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<(), Error> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
    f.write_all(bytes)
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_every_file_with_private_keys_unreadable_by_others() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::generate(dir.path(), &[]).unwrap();
        for f in [
            &pki.apiserver,
            &pki.admin,
            &pki.controller_manager,
            &pki.scheduler,
            &pki.scheduler_serving,
        ] {
            let cert = std::fs::read_to_string(&f.cert).unwrap();
            assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{cert}");
            let mode = std::fs::metadata(&f.key).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", f.key.display());
        }
        let sa = std::fs::read_to_string(&pki.service_account_key).unwrap();
        assert!(sa.contains("PRIVATE KEY"), "{sa}");
        let sa_pub = std::fs::read_to_string(&pki.service_account_pub).unwrap();
        assert!(sa_pub.contains("PUBLIC KEY"), "{sa_pub}");
        assert!(!pki.ca_der.is_empty());
    }

    #[test]
    fn fixed_service_names_are_valid_dns_sans() {
        for name in ["localhost", "kubernetes.default.svc.cluster.local"] {
            assert!(matches!(dns(name), SanType::DnsName(_)), "{name}");
        }
    }
}
