#!/usr/bin/env bash
# Installs what the e2e tests and the demo need, idempotently:
#   - Debian packages (etcd, iptables, nftables, netfilter headers, promtool);
#   - kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet and
#     kube-proxy, built from the k8s.io/kubernetes Go module and cached outside the repo, keyed
#     by version;
#   - the real node's runtime: containerd, ctr and containerd-shim-runc-v2 built from the
#     github.com/containerd/containerd/v2 module, Debian's runc and containernetworking-plugins;
#   - istio-cni and its node agent (install-cni), built from the istio.io/istio module, and the
#     ambient test's stand-in ztunnel (e2e/ztunnel-standin) on istio's ZDS messages, and
#     istio-inpod (e2e/istio-inpod), istio-cni's in-pod rule builders for the inspection tests;
#   - helm, built from the helm.sh/helm/v4 module (it installs meshgate's chart, manifests/charts/meshgate);
#   - the real node's images (pause, busybox; install-cni and ztunnel-standin for ambient) as
#     OCI image-layout tarballs (e2e/images).
# Prints the Kubernetes bin directory as its last line; helm is linked into it as `helm` (the
# Makefile runs it from there; the e2e harness finds it in its own cache directory).
#
# Every version is pinned in one place: `kubernetes-version`, `containerd-version`,
# `istio-cni-version` and `helm-version` under [workspace.metadata.meshgate] in the top-level
# Cargo.toml. This script refuses to run when the k8s-openapi feature there names another minor version.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
log() { printf '[install-deps %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { printf '[install-deps] error: %s\n' "$*" >&2; exit 1; }

k8s_version=$(sed -n 's/^kubernetes-version *= *"\(v[0-9.]*\)".*/\1/p' "$root/Cargo.toml")
[[ -n "$k8s_version" ]] || die "no kubernetes-version in $root/Cargo.toml [workspace.metadata.meshgate]"
minor=$(cut -d. -f2 <<<"$k8s_version")
grep -q "k8s-openapi.*\"v1_${minor}\"" "$root/Cargo.toml" \
  || die "k8s-openapi's feature in Cargo.toml must be v1_${minor} to match kubernetes-version $k8s_version"

cache_root=${MESHGATE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/meshgate}
bin_dir="$cache_root/kubernetes/$k8s_version/bin"
# One run at a time per cache: two runs building the same component would move each other's
# half-written binaries into place. A second run waits, then finds everything built.
mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
if ! flock -n 9; then
  log "another install-deps.sh is using $cache_root; waiting for it"
  flock 9
fi
components=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)
pin() { sed -n "s/^$1 *= *\"\(v[^\"]*\)\".*/\1/p" "$root/Cargo.toml"; }
containerd_version=$(pin containerd-version)
istio_cni_version=$(pin istio-cni-version)
helm_version=$(pin helm-version)
[[ -n "$containerd_version" && -n "$istio_cni_version" && -n "$helm_version" ]] \
  || die "containerd-version, istio-cni-version and helm-version must be pinned in $root/Cargo.toml [workspace.metadata.meshgate]"

# --- Debian packages -------------------------------------------------------------------------
apt_packages=(etcd-server iptables nftables iproute2 prometheus
  runc containernetworking-plugins busybox-static gcc libc6-dev)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  [[ $(id -u) -eq 0 ]] || die "missing Debian packages (${missing[*]}); run this script as root or install them"
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # The etcd and prometheus packages start services on install, but meshgate runs its own etcd
  # on loopback ports it picks. A policy-rc.d that answers 101 is Debian's switch to keep
  # invoke-rc.d / deb-systemd-invoke from starting anything, so no process has to be hunted
  # down by name afterwards. Container images often ship one already; otherwise add it for the
  # duration of the install only.
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && own_policy=1
    trap '((own_policy)) && rm -f "$policy"' EXIT
  fi
  # --no-install-recommends keeps prometheus from pulling in its web UI assets and exporters.
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if ((own_policy)); then rm -f "$policy"; own_policy=0; fi
  # Nor at the next boot.
  for svc in etcd prometheus; do systemctl disable "$svc" >/dev/null 2>&1 || true; done
fi

# --- Kubernetes control-plane binaries -------------------------------------------------------
build_kubernetes() {
command -v go >/dev/null 2>&1 || die "Go is required to build the Kubernetes $k8s_version control plane (install Go 1.24 or newer, https://go.dev/dl)"
go_have=$(go env GOVERSION | sed 's/^go//')

work="$cache_root/kubernetes/$k8s_version/build"
mkdir -p "$work" "$bin_dir"
log "downloading the k8s.io/kubernetes@$k8s_version module"
modfile=$(cd "$work" && go mod download -json "k8s.io/kubernetes@$k8s_version" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
[[ -f "$modfile" ]] || die "could not download k8s.io/kubernetes@$k8s_version (is the Go module proxy reachable?)"

go_need=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$modfile")
if [[ "$(printf '%s\n%s\n' "$go_need" "$go_have" | sort -V | head -1)" != "$go_need" ]]; then
  die "Kubernetes $k8s_version needs Go >= $go_need, this machine has Go $go_have"
fi

# Every staging module is required at v0.0.0 and replaced by ./staging/...; Go ignores a
# dependency's replace directives, so point each at its published v0.X.Y tag instead.
staging_version="v0.${k8s_version#v1.}"
{
  echo "module meshgate.local/k8s-build"
  echo
  echo "go $go_need"
  # Only the main module's godebug line applies, so carry over the one Kubernetes builds with.
  sed -n '/^godebug/p' "$modfile"
  echo
  echo "require k8s.io/kubernetes $k8s_version"
  echo
  echo "replace ("
  sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\t\1 => \1 '"$staging_version"'#p' "$modfile"
  echo ")"
} >"$work/go.mod"
n_replaced=$(grep -c ' => ' "$work/go.mod" || true)
((n_replaced > 20)) || die "found only $n_replaced staging modules in $modfile; the recipe needs updating"
cat >"$work/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
GO
log "building Kubernetes $k8s_version with Go $go_have ($n_replaced staging modules replaced)."
log "A cold build takes about 9 minutes on 2 idle cores (more when the machine is busy), kubelet about 1 more; it is cached in $bin_dir afterwards."
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$k8s_version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
i=0
for c in "${components[@]}"; do
  i=$((i + 1))
  if [[ -x "$bin_dir/$c" ]]; then log "[$i/${#components[@]}] $c: cached"; continue; fi
  log "[$i/${#components[@]}] building $c ..."
  start=$SECONDS
  (cd "$work" && nice go build -trimpath -ldflags "$ldflags" -o "$bin_dir/$c.tmp" "k8s.io/kubernetes/cmd/$c")
  mv "$bin_dir/$c.tmp" "$bin_dir/$c"
  log "[$i/${#components[@]}] built $c in $((SECONDS - start)) s"
done
touch "$bin_dir/.complete"
}

export GOTOOLCHAIN=local GOWORK=off CGO_ENABLED=0 GOFLAGS=-mod=mod
staging_version="v0.${k8s_version#v1.}"
have_all=1
for c in "${components[@]}"; do [[ -x "$bin_dir/$c" ]] || have_all=0; done
if ((have_all)) && [[ -f "$bin_dir/.complete" ]]; then
  log "reusing cached Kubernetes $k8s_version binaries in $bin_dir"
else
  build_kubernetes
fi

# --- The real node: containerd, istio-cni, images ----------------------------------------------
# go_install NAME VERSION_DIR COLD_TIME PKG@VERSION...: `go install`s the packages into
# VERSION_DIR/bin once; .complete marks a finished build, so an interrupted one is redone.
go_install() {
  local name=$1 dir=$2 cold=$3
  shift 3
  if [[ -f "$dir/bin/.complete" ]]; then
    log "reusing cached $name in $dir/bin"
    return
  fi
  command -v go >/dev/null 2>&1 || die "Go is required to build $name (install Go 1.26 or newer, https://go.dev/dl)"
  mkdir -p "$dir/bin"
  log "building $name; a cold build takes about $cold on 2 idle cores, cached in $dir/bin afterwards"
  local start=$SECONDS
  GOBIN="$dir/bin" nice go install -trimpath "${go_flags[@]}" "$@"
  touch "$dir/bin/.complete"
  log "built $name in $((SECONDS - start)) s"
}

# containerd 2.x from its Go module (no replace directives, so `go install pkg@version` works).
# btrfs needs cgo and devmapper/zfs need host tools this node does not use: the overlayfs
# snapshotter is all it needs.
go_flags=(-tags "no_btrfs no_devmapper no_zfs"
  -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version")
go_install "containerd $containerd_version" "$cache_root/containerd/$containerd_version" "1 minute" \
  "github.com/containerd/containerd/v2/cmd/containerd@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/ctr@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$containerd_version"

go_flags=(-ldflags "-s -w")
go_install "istio-cni $istio_cni_version" "$cache_root/istio-cni/$istio_cni_version" "3 minutes" \
  "istio.io/istio/cni/cmd/istio-cni@$istio_cni_version"
# istio-cni's node agent (the istio-cni DaemonSet's `install-cni`), which the ambient real-node
# test runs: it installs the plugin itself and serves ztunnel's ZDS socket.
go_install "istio-cni's node agent $istio_cni_version" "$cache_root/istio-cni-agent/$istio_cni_version" "half a minute after istio-cni's (24 s measured, Go caches shared)" \
  "istio.io/istio/cni/cmd/install-cni@$istio_cni_version"

# helm 4 (helm.sh/helm/v4 has no replace directives either). The version is stamped as helm's
# own release build does, so `helm version` names the pin.
go_flags=(-ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version -X helm.sh/helm/v4/internal/version.gitTreeState=clean")
go_install "helm $helm_version" "$cache_root/helm/$helm_version" "12 minutes (measured beside other builds)" \
  "helm.sh/helm/v4/cmd/helm@$helm_version"
ln -sfn "$cache_root/helm/$helm_version/bin/helm" "$bin_dir/helm"

# go_main NAME DIR REQUIRE: builds e2e/NAME/main.go, a small program of the tests, in a module
# that requires REQUIRE ("module version"), into DIR/bin/NAME; rebuilt when main.go changes.
go_main() {
  local name=$1 dir=$2 require=$3 inputs
  inputs=$(sha256sum "$here/$name/main.go" | cut -d' ' -f1)
  if [[ -x "$dir/bin/$name" && -f "$dir/bin/.inputs" && "$(cat "$dir/bin/.inputs")" == "$inputs" ]]; then
    log "reusing cached $name in $dir/bin"
    return
  fi
  log "building $name"
  mkdir -p "$dir/build" "$dir/bin"
  cp "$here/$name/main.go" "$dir/build/main.go"
  printf 'module meshgate.local/%s\n\ngo 1.26\n\nrequire %s\n' "$name" "$require" >"$dir/build/go.mod"
  (cd "$dir/build" && nice go build -trimpath -ldflags "-s -w" -o "$dir/bin/$name" .)
  echo "$inputs" >"$dir/bin/.inputs"
}

# cri-status (e2e/cri-status/main.go): a few lines of Go that print a CRI runtime's verbose
# status, so the tests can see which CNI config containerd really loaded. Its module requires
# the k8s.io/cri-api release of the pinned Kubernetes version.
go_main cri-status "$cache_root/cri-status/$k8s_version" "k8s.io/cri-api $staging_version"

# ztunnel-standin (e2e/ztunnel-standin/main.go): the ambient test's stand-in for ztunnel, with
# istio's own ZDS messages (istio.io/istio/pkg/zdsapi at the pinned version).
zt_dir="$cache_root/ztunnel-standin/$istio_cni_version"
go_main ztunnel-standin "$zt_dir" "istio.io/istio $istio_cni_version"

# istio-inpod (e2e/istio-inpod/main.go): writes istio-cni's ambient in-pod rules into the
# namespace it runs in, with istio's own rule builders at the pinned version, for the pod-level
# overrides an annotated pod gets; the privileged inspection tests judge what it wrote.
go_main istio-inpod "$cache_root/istio-inpod/$istio_cni_version" "istio.io/istio $istio_cni_version"

# Images, rebuilt when their inputs change (the C source, the script, Debian's busybox).
images="$cache_root/images"
inputs=$( (cat "$here/images/pause.c" "$here/images/build-images.sh" "$here/images/oci-image.sh"; dpkg-query -W busybox-static) | sha256sum | cut -d' ' -f1)
if [[ -f "$images/.inputs" && "$(cat "$images/.inputs")" == "$inputs" && -f "$images/pause.tar" && -f "$images/busybox.tar" ]]; then
  log "reusing cached node images in $images"
else
  log "building the node images (pause, busybox) in $images"
  "$here/images/build-images.sh" "$images"
  echo "$inputs" >"$images/.inputs"
fi

# The ambient test's images (istio-cni's node agent, the stand-in ztunnel), rebuilt when the
# binaries, the scripts or Debian's netfilter tools change.
istio_images="$images/istio/$istio_cni_version"
istio_bins=("$cache_root/istio-cni-agent/$istio_cni_version/bin/install-cni"
  "$cache_root/istio-cni/$istio_cni_version/bin/istio-cni" "$zt_dir/bin/ztunnel-standin")
inputs=$( (sha256sum "${istio_bins[@]}" | cut -d' ' -f1; cat "$here/images/build-istio-images.sh" "$here/images/oci-image.sh"
  dpkg-query -W iptables nftables libxtables12 libnftables1) | sha256sum | cut -d' ' -f1)
if [[ -f "$istio_images/.inputs" && "$(cat "$istio_images/.inputs")" == "$inputs" && -f "$istio_images/install-cni.tar" && -f "$istio_images/ztunnel-standin.tar" ]]; then
  log "reusing cached ambient images in $istio_images"
else
  log "building the ambient images (install-cni, ztunnel-standin) in $istio_images"
  "$here/images/build-istio-images.sh" "$istio_images" "${istio_bins[@]}"
  echo "$inputs" >"$istio_images/.inputs"
fi

echo "$bin_dir"
