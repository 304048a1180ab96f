#!/usr/bin/env bash
# The image reference of meshgate's chart: pinned by digest, in one place
# (manifests/charts/meshgate/values.yaml, `image:`), so every install from the chart runs exactly the
# bytes a release pushed.
#
#   manifests/charts/images.sh pin ghcr.io/meshgate/meshgate:TAG@sha256:DIGEST  # a release, its push
#   manifests/charts/images.sh check [--release]                                # make test; a release
#
# `pin` changes the tag and digest only, in values.yaml and in Chart.yaml's
# artifacthub.io/images annotation (a mirror sets `image.repository` and keeps them,
# docs/operations.md). `check` renders the chart with `helm template` (HELM, or helm on PATH)
# with its default values and with tls.mode certManager, and fails unless every meshgate
# container, the uninstall hook's included, names the image by tag and digest; and renders it
# with the real node's values (e2e/chart/real-node-values.yaml), which must run the local
# build by tag alone (its own image, imported on the node, has no registry digest).
# It also fails unless Chart.yaml's artifacthub.io/images annotation names exactly the image the
# default values render. `--release` also refuses the all-zero digest an unreleased tree carries. Exit 0 when all
# holds, 1 when not, 2 on a usage error.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
chart="$here/meshgate"
values="$chart/values.yaml"
chart_yaml="$chart/Chart.yaml"
e2e_values="$here/../../e2e/chart/real-node-values.yaml"
helm="${HELM:-helm}"
name="ghcr.io/meshgate/meshgate"
digest_re='sha256:[0-9a-f]{64}'
zero="sha256:$(printf '0%.0s' {1..64})"

# Every `image:` value of meshgate's containers in the chart rendered with these flags.
images_of() {
  "$helm" template meshgate "$chart" --namespace kube-system "$@" \
    | sed -n 's/^ *image: *//p' | tr -d '"' | grep 'meshgate/meshgate' || true
}

pin() {
  local ref="$1"
  if [[ ! "$ref" =~ ^$name:([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})@($digest_re)$ ]]; then
    echo "images.sh: want $name:TAG@sha256:<64 hex>, got '$ref'" >&2
    exit 2
  fi
  local tag="${BASH_REMATCH[1]}" digest="${BASH_REMATCH[2]}"
  # Rewrite the two fields under the one top-level `image:` key.
  awk -v tag="$tag" -v digest="$digest" '
    /^image:/ { inside = 1; print; next }
    inside && /^[^ #]/ { inside = 0 }
    inside && /^  tag:/ { print "  tag: " tag; next }
    inside && /^  digest:/ { print "  digest: " digest; next }
    { print }
  ' "$values" >"$values.tmp"
  mv "$values.tmp" "$values"
  # And the Artifact Hub annotation that names it.
  sed -E "s#^( *image: )$name:.*#\1$name:$tag@$digest#" "$chart_yaml" >"$chart_yaml.tmp"
  mv "$chart_yaml.tmp" "$chart_yaml"
  echo "pinned $name:$tag@$digest in $values and $chart_yaml"
}

# The images Chart.yaml's artifacthub.io/images annotation names, one a line.
annotated_images() {
  awk '/^  artifacthub.io\/images:/ { inside = 1; next }
       inside && /^  [^ ]/ { inside = 0 }
       inside && /image:/ { sub(/^ *image: */, ""); print }' "$chart_yaml"
}

check() {
  local release="${1:-}" failed=0 install image
  local -a installs=("default values" "tls.mode certManager")
  local -a flags=("" "--set tls.mode=certManager")
  for i in "${!installs[@]}"; do
    install="${installs[$i]}"
    # shellcheck disable=SC2086 # the flags are words
    mapfile -t found < <(images_of ${flags[$i]})
    [[ ${#found[@]} -gt 0 ]] || { echo "images.sh: no meshgate image in the chart ($install)" >&2; failed=1; }
    for image in "${found[@]}"; do
      if [[ ! "$image" =~ :[A-Za-z0-9_.-]+@$digest_re$ ]]; then
        echo "images.sh: the chart ($install) runs '$image', not pinned by tag and digest" >&2
        failed=1
      elif [[ "$release" == "--release" && "$image" == *"@$zero" ]]; then
        echo "images.sh: the chart ($install) still carries the unreleased all-zero digest" >&2
        failed=1
      fi
    done
  done
  # Chart indexes show the annotation: it must name exactly the image the defaults render.
  local rendered annotated
  rendered="$(images_of | sort -u)"
  annotated="$(annotated_images | sort -u)"
  if [[ "$rendered" != "$annotated" ]]; then
    echo "images.sh: Chart.yaml's artifacthub.io/images names '$annotated', the chart renders '$rendered'" >&2
    failed=1
  fi
  mapfile -t found < <(images_of --values "$e2e_values")
  [[ ${#found[@]} -gt 0 ]] || { echo "images.sh: no meshgate image with the real node's values" >&2; failed=1; }
  for image in "${found[@]}"; do
    if [[ "$image" != "localhost/meshgate/meshgate:e2e" ]]; then
      echo "images.sh: the real node's values run '$image', not the local build" >&2
      failed=1
    fi
  done
  if [[ $failed -eq 0 ]]; then
    echo "images.sh: the chart pins the image by digest; the real node's values run the local build"
  fi
  return $failed
}

case "${1:-}" in
  pin) [[ $# -eq 2 ]] || { echo "usage: $0 pin $name:TAG@sha256:DIGEST" >&2; exit 2; }; pin "$2" ;;
  check) check "${2:-}" ;;
  *) echo "usage: $0 pin REF | check [--release]" >&2; exit 2 ;;
esac
