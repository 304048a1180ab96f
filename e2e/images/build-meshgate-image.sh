#!/usr/bin/env bash
# Builds meshgate's image as an OCI image-layout tarball for the real node, which cannot pull:
# the release binaries and the libraries they load (meshgate-files.sh, exactly what the
# Dockerfile copies), over a stand-in for distroless/cc-debian12 made from this machine's
# Debian 12 C runtime (meshgate-files.sh --base). Same entrypoint and PATH as the Dockerfile's
# image. Named localhost/meshgate/meshgate:e2e (real::node::MESHGATE_IMAGE); the real node's
# chart values (e2e/chart/real-node-values.yaml) point the chart at that name.
#
# Usage: build-meshgate-image.sh BIN_DIR OUT_TAR
#   BIN_DIR  holds meshgate-agent, meshgate-webhook and kubectl-meshgate (make: target/release;
#            `cargo build -p meshgate-agent` builds the agent crate's two binaries)
set -euo pipefail

bin_dir=${1:?usage: build-meshgate-image.sh BIN_DIR OUT_TAR}
out=${2:?usage: build-meshgate-image.sh BIN_DIR OUT_TAR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=oci-image.sh
source "$here/oci-image.sh"

bins=("$bin_dir/meshgate-agent" "$bin_dir/meshgate-webhook" "$bin_dir/kubectl-meshgate")
root=$(mktemp -d)
chmod 755 "$root"  # the image's /: the webhook runs as 65532 and must traverse it
trap 'rm -rf "$root"' EXIT
bash "$here/meshgate-files.sh" --base "$root" "${bins[@]}"
bash "$here/meshgate-files.sh" "$root" "${bins[@]}"
mkdir -p "$(dirname "$out")"
oci_image "$out" "localhost/meshgate/meshgate:e2e" "$root" \
  '"Entrypoint":["/usr/local/bin/meshgate-agent"],"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin","SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"]'
echo "$out"
