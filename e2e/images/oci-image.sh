#!/usr/bin/env bash
# Sourced, not run: oci_image, which writes one single-layer OCI image-layout tarball, without a
# registry or a container engine. Used by build-images.sh (the node's pause and busybox) and
# build-meshgate-image.sh (meshgate's own image), so every image the real node imports is made
# the same way.
# Deterministic: fixed mtimes, owners and file order, so the same inputs give the same digests.

# oci_image OUT_TAR REF ROOTFS CONFIG_FRAGMENT
#   OUT_TAR          the tarball to write (importable with `ctr -n k8s.io images import`)
#   REF              the image name, fully qualified (containerd's CRI would prefix docker.io/)
#   ROOTFS           the directory that becomes the image's only layer
#   CONFIG_FRAGMENT  JSON members of the image config's "config" object (Entrypoint, Env, ...)
oci_image() (
  set -euo pipefail
  local out=$1 ref=$2 rootfs=$3 process=$4
  local arch work
  arch=$(dpkg --print-architecture)
  work=$(mktemp -d)
  # The body is a subshell, so this trap also runs when a step fails (set -e): no partial
  # layer is left in /tmp.
  trap 'rm -rf "$work"' EXIT
  local layout="$work/layout" blobs="$work/layout/blobs/sha256"
  mkdir -p "$blobs"
  _oci_sha() { sha256sum "$1" | cut -d' ' -f1; }
  _oci_size() { stat -c %s "$1"; }
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 --format=posix \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    -C "$rootfs" -cf "$work/layer.tar" .
  local layer_digest layer_size
  layer_digest=$(_oci_sha "$work/layer.tar"); layer_size=$(_oci_size "$work/layer.tar")
  mv "$work/layer.tar" "$blobs/$layer_digest"

  printf '{"architecture":"%s","os":"linux","config":{%s},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$arch" "$process" "$layer_digest" >"$work/config.json"
  local config_digest config_size
  config_digest=$(_oci_sha "$work/config.json"); config_size=$(_oci_size "$work/config.json")
  mv "$work/config.json" "$blobs/$config_digest"

  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
    "$config_digest" "$config_size" "$layer_digest" "$layer_size" >"$work/manifest.json"
  local manifest_digest manifest_size
  manifest_digest=$(_oci_sha "$work/manifest.json"); manifest_size=$(_oci_size "$work/manifest.json")
  mv "$work/manifest.json" "$blobs/$manifest_digest"

  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"%s","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest_digest" "$manifest_size" "$arch" "$ref" "${ref##*:}" >"$layout/index.json"
  printf '{"imageLayoutVersion":"1.0.0"}' >"$layout/oci-layout"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$layout" -cf "$out.tmp" .
  mv "$out.tmp" "$out"
)
