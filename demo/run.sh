#!/usr/bin/env bash
# The meshgate demo (interim): verifies a bundled example node's CNI config as a runtime
# would load it, before and after the mesh plugin is chained (scenarios S3 then S1).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
agent="$root/target/debug/meshgate-agent"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$root/demo/example/." "$work/"
check() {
  set +e
  "$agent" check --cni-conf-dir "$work/net.d" --cni-bin-dir "$work/bin" --require-plugin linkerd-cni
  echo "(exit code $?)"
  set -e
}
echo "== S3: Calico's conflist is on disk, linkerd-cni is not chained yet"
check
echo
echo "== S1: the linkerd-cni installer appends its plugin to the conflist"
cp "$root/core/testdata/calico-linkerd.conflist" "$work/net.d/10-calico.conflist"
check
