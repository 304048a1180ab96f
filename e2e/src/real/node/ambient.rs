//! Istio ambient's node components for a real node: the images of istio-cni's node agent and
//! of the stand-in ztunnel, imported into the node's containerd (no registry), and the node's
//! unix sockets as its network namespace lists them.
//!
//! In: the images `e2e/install-deps.sh` builds (`e2e/images/build-istio-images.sh`) into
//! `<cache>/images/istio/<istio-cni-version>`, `ss` from iproute2. Out: the images in
//! containerd's `k8s.io` namespace; [`UnixSocket`]s.

use super::*;

/// istio-cni's node agent (`install-cni`, with the `istio-cni` plugin and the netfilter tools).
pub const INSTALL_CNI_IMAGE: &str = "localhost/meshgate-e2e/install-cni:1";
/// The stand-in ztunnel (`e2e/ztunnel-standin`).
pub const ZTUNNEL_STANDIN_IMAGE: &str = "localhost/meshgate-e2e/ztunnel-standin:1";

/// The node's view of `/proc` for istio-cni's node agent (its `cni-host-procfs` hostPath):
/// the machine's `/proc` with `1` bound to the node's first process, containerd. The node
/// agent takes `<proc>/1/ns/net` for the host's network namespace (`statHostNetns`, istio/istio
/// `cni/pkg/nodeagent/podcgroupns_linux.go`) and refuses to start when it cannot stat it. The
/// nodes share the machine's PID namespace, whose pid 1 is the machine's init: not the node's
/// network namespace, and on this machine kind not even `stat`-able by root (`Permission
/// denied`). Only the node's mount namespace sees these mounts.
pub const NODE_PROC: &str = "/run/meshgate-node-proc";

/// One unix socket of the node's network namespace, as `ss -x` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnixSocket {
    /// `LISTEN`, `ESTAB`, ...
    pub state: String,
    /// The address it is bound to or accepted on (`*` for none).
    pub local: String,
}

impl RealNode {
    /// Imports the ambient images into containerd, as [`RealNode::start`] imports the others.
    pub async fn import_ambient_images(&self) -> Result<(), Error> {
        let dir = paths::cache_dir()?
            .join("images/istio")
            .join(paths::pinned_version("istio-cni-version")?);
        for image in ["install-cni.tar", "ztunnel-standin.tar"] {
            let path = dir.join(image);
            if !path.is_file() {
                return Err(binaries::missing("the ambient images", &path));
            }
            self.import_image(&path, "the ambient images").await?;
        }
        Ok(())
    }

    /// Lays out [`NODE_PROC`] in the node's mount namespace.
    pub async fn make_node_proc(&self) -> Result<(), Error> {
        let containerd = self
            .procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|p| p.name == "containerd")
            .map(|p| p.pid)
            .ok_or_else(|| Error::RealNode {
                part: "containerd",
                detail: "not running".into(),
            })?;
        let script = format!(
            "mkdir -p {NODE_PROC} && mount --bind /proc {NODE_PROC} && mount --bind /proc/{containerd} {NODE_PROC}/1"
        );
        let mnt = format!("--mount=/proc/{containerd}/ns/mnt");
        self.nsenter("the node's /proc view", &[&mnt, "--", "sh", "-ec", &script])
            .await
            .map(drop)
    }

    /// `nsenter ARGS`, bounded; its stdout, or an error naming `part` with its stderr.
    async fn nsenter(&self, part: &'static str, args: &[&str]) -> Result<String, Error> {
        let out = wait::bounded(part, Duration::from_secs(10), async {
            tokio::process::Command::new(&self.bins.nsenter)
                .args(args)
                .output()
                .await
                .map_err(|e| Error::io("running nsenter", e))
        })
        .await?;
        if !out.status.success() {
            return Err(Error::RealNode {
                part,
                detail: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The unix sockets of the node's network namespace whose address is `path` (`ss -xa`,
    /// which reads them with unix sock_diag, as the kernel keeps them per network namespace).
    pub async fn unix_sockets(&self, path: &str) -> Result<Vec<UnixSocket>, Error> {
        let net = format!("--net={}", self.fp.netns_pin.display());
        let out = self.nsenter("ss", &[&net, "--", "ss", "-xaH"]).await?;
        Ok(parse_ss_unix(&out, path))
    }
}

/// `ss -xaH` lines: `Netid State Recv-Q Send-Q Local-Address Port Peer-Address Port`, the
/// local address being the path (or `*`).
pub(super) fn parse_ss_unix(text: &str, path: &str) -> Vec<UnixSocket> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.len() >= 5 && f[4] == path).then(|| UnixSocket {
                state: f[1].to_owned(),
                local: f[4].to_owned(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ss_lines_name_the_sockets_of_a_path() {
        let text = "\
u_seq LISTEN 0 4096 /var/run/ztunnel/ztunnel.sock 81234 * 0
u_seq ESTAB  0 0    /var/run/ztunnel/ztunnel.sock 81240 * 81239
u_str ESTAB  0 0    * 81239 * 81240
u_str LISTEN 0 4096 /var/run/istio-cni/pluginevent.sock 8123 * 0
";
        let got = parse_ss_unix(text, "/var/run/ztunnel/ztunnel.sock");
        assert_eq!(
            got.iter().map(|s| s.state.as_str()).collect::<Vec<_>>(),
            ["LISTEN", "ESTAB"]
        );
        assert!(parse_ss_unix(text, "/nowhere").is_empty());
    }
}
