#!/usr/bin/env bash
# Builds the e2e real node's container images as OCI image-layout tarballs, without a registry:
#   - pause:   e2e/images/pause.c compiled static (holds a pod sandbox's namespaces, reaps);
#   - busybox: Debian's busybox-static, the workload and stand-in sidecar containers.
# Usage: build-images.sh OUT_DIR. Writes OUT_DIR/{pause,busybox}.tar, each importable with
# `ctr -n k8s.io images import`, named by the io.containerd.image.name annotation. The names are
# fully qualified under localhost/ (never pullable) and must match e2e/src/real_node.rs.
# Deterministic: fixed mtimes, owners and file order, so the same inputs give the same digests.
set -euo pipefail

out=${1:?usage: build-images.sh OUT_DIR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
arch=$(dpkg --print-architecture)
busybox=/bin/busybox
[[ -x $busybox ]] && file -L "$busybox" | grep -q 'statically linked' \
  || { echo "build-images: $busybox is not Debian's busybox-static" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

sha() { sha256sum "$1" | cut -d' ' -f1; }
size() { stat -c %s "$1"; }

# image NAME ROOTFS CONFIG_JSON_FRAGMENT: writes $out/NAME.tar for image reference $ref.
image() {
  local name=$1 ref=$2 rootfs=$3 process=$4
  local layout="$work/$name-layout" blobs
  blobs="$layout/blobs/sha256"
  mkdir -p "$blobs"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --format=posix \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    -C "$rootfs" -cf "$work/layer.tar" .
  local layer_digest layer_size
  layer_digest=$(sha "$work/layer.tar"); layer_size=$(size "$work/layer.tar")
  mv "$work/layer.tar" "$blobs/$layer_digest"

  printf '{"architecture":"%s","os":"linux","config":{%s},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$arch" "$process" "$layer_digest" >"$work/config.json"
  local config_digest config_size
  config_digest=$(sha "$work/config.json"); config_size=$(size "$work/config.json")
  mv "$work/config.json" "$blobs/$config_digest"

  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
    "$config_digest" "$config_size" "$layer_digest" "$layer_size" >"$work/manifest.json"
  local manifest_digest manifest_size
  manifest_digest=$(sha "$work/manifest.json"); manifest_size=$(size "$work/manifest.json")
  mv "$work/manifest.json" "$blobs/$manifest_digest"

  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"%s","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest_digest" "$manifest_size" "$arch" "$ref" "${ref##*:}" >"$layout/index.json"
  printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$layout" -cf "$out/$name.tar.tmp" .
  mv "$out/$name.tar.tmp" "$out/$name.tar"
}

# pause
mkdir -p "$work/pause-root"
gcc -static -Os -s -o "$work/pause-root/pause" "$here/pause.c"
image pause "localhost/meshgate-e2e/pause:1" "$work/pause-root" '"Entrypoint":["/pause"]'

# busybox: the binary plus the applet links the tests call by path.
mkdir -p "$work/busybox-root/bin"
cp "$busybox" "$work/busybox-root/bin/busybox"
for applet in sh sleep cat ls ip; do ln -s busybox "$work/busybox-root/bin/$applet"; done
image busybox "localhost/meshgate-e2e/busybox:1" "$work/busybox-root" '"Cmd":["/bin/sh"],"Env":["PATH=/bin"]'
