#!/usr/bin/env bash
# The image reference of meshgate's manifests: pinned by digest, in one place
# (manifests/base/kustomization.yaml, `images:`), so both installs (manifests/ and
# manifests/cert-manager/) run exactly the bytes a release pushed.
#
#   manifests/images.sh pin ghcr.io/meshgate/meshgate:TAG@sha256:DIGEST  # a release, its push
#   manifests/images.sh check [--release]                                # make test; a release
#
# `pin` changes the tag and digest only: overlays select the image by that name (your own
# registry goes into your kustomization as `newName` + `digest`, docs/operations.md).
# `check` renders manifests/, manifests/cert-manager/ and e2e/overlay/ with `kubectl
# kustomize` (KUBECTL, or kubectl on PATH; from a copy, with empty TLS files where
# tls/generate.sh has not run) and fails unless every meshgate container of the
# two installs names the image by tag and digest, and the e2e overlay's its local build by
# tag alone (its own image, imported on the node, has no registry digest). `--release` also
# refuses the all-zero digest an unreleased tree carries. Exit 0 when all holds, 1 when not,
# 2 on a usage error.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
base="$here/base/kustomization.yaml"
kubectl="${KUBECTL:-kubectl}"
name="ghcr.io/meshgate/meshgate"
digest_re='sha256:[0-9a-f]{64}'
zero="sha256:$(printf '0%.0s' {1..64})"
tree=""

# Every `image:` value of meshgate's containers in a rendered kustomization.
images_of() {
  "$kubectl" kustomize "$1" | sed -n 's/^ *image: *//p' | grep 'meshgate/meshgate' || true
}

pin() {
  local ref="$1"
  if [[ ! "$ref" =~ ^$name:([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})@($digest_re)$ ]]; then
    echo "images.sh: want $name:TAG@sha256:<64 hex>, got '$ref'" >&2
    exit 2
  fi
  local tag="${BASH_REMATCH[1]}" digest="${BASH_REMATCH[2]}"
  # Rewrite the two fields under the one `images:` entry.
  awk -v tag="$tag" -v digest="$digest" '
    /^images:/ { inside = 1; print; next }
    inside && /^[^ #-]/ { inside = 0 }
    inside && /^    newTag:/ { print "    newTag: " tag; next }
    inside && /^    digest:/ { print "    digest: " digest; next }
    { print }
  ' "$base" >"$base.tmp"
  mv "$base.tmp" "$base"
  echo "pinned $name:$tag@$digest in $base"
}

check() {
  local release="${1:-}" failed=0 install image
  tree="$(mktemp -d)"
  trap 'rm -rf "$tree"' EXIT
  mkdir -p "$tree/e2e"
  cp -r "$here" "$tree/manifests"
  cp -r "$here/../e2e/overlay" "$tree/e2e/overlay"
  for f in tls.crt tls.key ca.crt; do
    [[ -e "$tree/manifests/tls/$f" ]] || : >"$tree/manifests/tls/$f"
  done
  for install in "$tree/manifests" "$tree/manifests/cert-manager"; do
    while read -r image; do
      if [[ ! "$image" =~ :[A-Za-z0-9_.-]+@$digest_re$ ]]; then
        echo "images.sh: ${install#"$tree/"} runs '$image', not pinned by tag and digest" >&2
        failed=1
      elif [[ "$release" == "--release" && "$image" == *"@$zero" ]]; then
        echo "images.sh: ${install#"$tree/"} still carries the unreleased all-zero digest" >&2
        failed=1
      fi
    done < <(images_of "$install")
    [[ -n "$(images_of "$install")" ]] || { echo "images.sh: no meshgate image in ${install#"$tree/"}" >&2; failed=1; }
  done
  local overlay="$tree/e2e/overlay"
  while read -r image; do
    if [[ "$image" != "localhost/meshgate/meshgate:e2e" ]]; then
      echo "images.sh: the e2e overlay runs '$image', not its local build" >&2
      failed=1
    fi
  done < <(images_of "$overlay")
  [[ -n "$(images_of "$overlay")" ]] || { echo "images.sh: no meshgate image in the e2e overlay" >&2; failed=1; }
  if [[ $failed -eq 0 ]]; then
    echo "images.sh: both installs pin the image by digest; the e2e overlay runs its local build"
  fi
  return $failed
}

case "${1:-}" in
  pin) [[ $# -eq 2 ]] || { echo "usage: $0 pin $name:TAG@sha256:DIGEST" >&2; exit 2; }; pin "$2" ;;
  check) check "${2:-}" ;;
  *) echo "usage: $0 pin REF | check [--release]" >&2; exit 2 ;;
esac
