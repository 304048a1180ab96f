//! Where a real node's binaries and images are.
//!
//! In: `MESHGATE_K8S_BIN_DIR`, `MESHGATE_CNI_PLUGINS_DIR`, `MESHGATE_IMAGE_TAR`, the cache
//! `e2e/install-deps.sh` fills, and `PATH`. Out: [`NodeBinaries`], or [`Error::RealNode`]
//! naming the missing part and the command that builds it.

use super::*;

/// The node's binaries and images, as `e2e/install-deps.sh` caches them.
#[derive(Debug, Clone)]
pub struct NodeBinaries {
    /// kubelet, built from the pinned `k8s.io/kubernetes` module (beside kube-apiserver).
    pub kubelet: PathBuf,
    /// containerd, built from `github.com/containerd/containerd/v2` at `containerd-version`.
    pub containerd: PathBuf,
    /// ctr, from the same build (image import, task listing, teardown).
    pub ctr: PathBuf,
    /// Directory holding `containerd-shim-runc-v2`, put first on containerd's `PATH`.
    pub shim_dir: PathBuf,
    /// runc (Debian's).
    pub runc: PathBuf,
    /// Directory of the reference CNI plugins (Debian's `containernetworking-plugins`).
    pub cni_plugins: PathBuf,
    /// istio-cni, built from `istio.io/istio` at `istio-cni-version`.
    pub istio_cni: PathBuf,
    /// Directory of the OCI image-layout tarballs (`pause.tar`, `busybox.tar`).
    pub images: PathBuf,
    /// meshgate's image tarball ([`MESHGATE_IMAGE`]), built from this tree by `make`.
    pub meshgate_image: PathBuf,
    /// `cri-status` (e2e/cri-status/main.go): the runtime's verbose CRI status, CNI part.
    pub cri_status: PathBuf,
    /// kube-proxy, built from the pinned `k8s.io/kubernetes` module (beside the kubelet).
    pub kube_proxy: PathBuf,
    /// util-linux's nsenter and unshare: the node's daemons run in its own network and mount
    /// namespaces.
    pub nsenter: PathBuf,
    /// See `nsenter`.
    pub unshare: PathBuf,
}

/// Env var naming the directory of the reference CNI plugins (default `/usr/lib/cni`).
pub const CNI_PLUGINS_ENV: &str = "MESHGATE_CNI_PLUGINS_DIR";

impl NodeBinaries {
    /// Finds every binary and image; the error names the first missing part and the script
    /// that installs it.
    pub fn locate() -> Result<Self, Error> {
        let cache = paths::cache_dir()?;
        let containerd_dir = cache
            .join("containerd")
            .join(paths::pinned_version("containerd-version")?)
            .join("bin");
        let istio_dir = cache
            .join("istio-cni")
            .join(paths::pinned_version("istio-cni-version")?)
            .join("bin");
        let cni_plugins = env_var(CNI_PLUGINS_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/lib/cni"));
        let images = cache.join("images");
        let need = |part: &'static str, path: PathBuf| {
            if is_executable(&path) {
                Ok(path)
            } else {
                Err(missing(part, &path))
            }
        };
        for plugin in ["bridge", "host-local", "portmap", "loopback"] {
            need("the reference CNI plugins", cni_plugins.join(plugin))?;
        }
        for image in ["pause.tar", "busybox.tar"] {
            let path = images.join(image);
            if !path.is_file() {
                return Err(missing("the node images", &path));
            }
        }
        let tool = |name: &'static str| {
            find_on_path(name)
                .or_else(|| Some(Path::new("/usr/bin").join(name)).filter(|p| is_executable(p)))
                .ok_or_else(|| missing(name, &Path::new("$PATH").join(name)))
        };
        let meshgate_image = meshgate_image()?;
        Ok(Self {
            meshgate_image,
            kubelet: need("kubelet", paths::k8s_bin_dir()?.join("kubelet"))?,
            kube_proxy: need("kube-proxy", paths::k8s_bin_dir()?.join("kube-proxy"))?,
            nsenter: tool("nsenter")?,
            unshare: tool("unshare")?,
            containerd: need("containerd", containerd_dir.join("containerd"))?,
            ctr: need("ctr", containerd_dir.join("ctr"))?,
            shim_dir: need(
                "containerd-shim-runc-v2",
                containerd_dir.join("containerd-shim-runc-v2"),
            )
            .map(|_| containerd_dir.clone())?,
            runc: find_on_path("runc")
                .or_else(|| Some(PathBuf::from("/usr/sbin/runc")).filter(|p| is_executable(p)))
                .ok_or_else(|| missing("runc", Path::new("$PATH/runc")))?,
            cni_plugins,
            istio_cni: need("istio-cni", istio_dir.join("istio-cni"))?,
            images,
            cri_status: need(
                "cri-status",
                cache
                    .join("cri-status")
                    .join(paths::kubernetes_version()?)
                    .join("bin/cri-status"),
            )?,
        })
    }
}

/// meshgate's image tarball: `MESHGATE_IMAGE_TAR`, or the one `make` builds beside the
/// workspace's target dir; an error names the commands that build it.
fn meshgate_image() -> Result<PathBuf, Error> {
    let meshgate_image = match env_var(MESHGATE_IMAGE_ENV) {
        Some(path) => PathBuf::from(path),
        None => crate::sim::node::workspace_bin_dir()
            .map_err(|e| Error::io("finding the workspace's target dir", e))?
            .parent()
            .map(|target| target.join("meshgate-image/meshgate.tar"))
            .unwrap_or_default(),
    };
    if !meshgate_image.is_file() {
        return Err(Error::RealNode {
            part: "meshgate's image",
            detail: format!(
                "{} is missing: build it with `e2e/images/build-meshgate-image.sh target/release {0}` \
                 after `cargo build --release -p meshgate-agent -p meshgate-webhook` (make test does)",
                meshgate_image.display()
            ),
        });
    }
    Ok(meshgate_image)
}

pub(super) fn missing(part: &'static str, path: &Path) -> Error {
    Error::RealNode {
        part,
        detail: format!(
            "{} is missing: run `e2e/install-deps.sh` (make test does)",
            path.display()
        ),
    }
}
