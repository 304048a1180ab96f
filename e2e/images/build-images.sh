#!/usr/bin/env bash
# Builds the e2e real node's container images as OCI image-layout tarballs, without a registry:
#   - pause:   e2e/images/pause.c compiled static (holds a pod sandbox's namespaces, reaps);
#   - busybox: Debian's busybox-static, the workload and stand-in sidecar containers.
# Usage: build-images.sh OUT_DIR. Writes OUT_DIR/{pause,busybox}.tar, each importable with
# `ctr -n k8s.io images import`, named by the io.containerd.image.name annotation. The names are
# fully qualified under localhost/ (never pullable) and must match e2e/src/real/node/mod.rs.
# The tarballs are written by oci_image (oci-image.sh), deterministically.
set -euo pipefail

out=${1:?usage: build-images.sh OUT_DIR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=oci-image.sh
source "$here/oci-image.sh"
busybox=/bin/busybox
[[ -x $busybox ]] && file -L "$busybox" | grep -q 'statically linked' \
  || { echo "build-images: $busybox is not Debian's busybox-static" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# pause
mkdir -p "$work/pause-root"
gcc -static -Os -s -o "$work/pause-root/pause" "$here/pause.c"
oci_image "$out/pause.tar" "localhost/meshgate-e2e/pause:1" "$work/pause-root" '"Entrypoint":["/pause"]'

# busybox: the binary plus the applet links the tests call by path.
mkdir -p "$work/busybox-root/bin"
cp "$busybox" "$work/busybox-root/bin/busybox"
for applet in sh sleep cat ls ip; do ln -s busybox "$work/busybox-root/bin/$applet"; done
oci_image "$out/busybox.tar" "localhost/meshgate-e2e/busybox:1" "$work/busybox-root" '"Cmd":["/bin/sh"],"Env":["PATH=/bin"]'
