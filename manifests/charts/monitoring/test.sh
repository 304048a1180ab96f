#!/usr/bin/env bash
# Checks and unit-tests meshgate's alert rules with promtool (Debian package `prometheus`,
# installed by e2e/install-deps.sh). Called by `make test` and by the e2e test
# `rbac::alert_rules_pass_promtool`.
#
# In: the chart's PrometheusRule, rendered with `helm template` (HELM, or helm on PATH) and
# its default values plus monitoring.prometheusRule=true (its `spec` is a plain Prometheus
# rules file), and tests/*.yaml (promtool unit tests naming `rule_files:
# [meshgate.rules.yaml]`). Out: promtool's report; exit 0 when the rules are valid and every
# test passes, 1 on a failure, 2 when promtool or helm is missing or the rules cannot be
# extracted.
#
# To use the rules without the Prometheus Operator: `manifests/charts/monitoring/test.sh --extract
# [HELM FLAGS]` prints the plain rules file (for your taint key: --set taintKey=...).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
helm="${HELM:-helm}"

# The lines under the rendered rule's top-level `spec:` key, de-indented by two spaces, up to
# the next top-level key or document separator.
extract() {
  "$helm" template meshgate "$here/../meshgate" --namespace kube-system \
    --set monitoring.prometheusRule=true --show-only templates/prometheusrule.yaml "$@" \
    | awk '
    /^spec:[[:space:]]*$/ { inside = 1; next }
    inside && /^(---|[^[:space:]#])/ { exit }
    inside { sub(/^  /, ""); print }
  '
}

if ! command -v "$helm" >/dev/null; then
  echo "test.sh: helm not found: e2e/install-deps.sh builds it (MESHGATE_HELM_BIN_DIR), or set HELM" >&2
  exit 2
fi
if [[ "${1:-}" == "--extract" ]]; then
  shift
  extract "$@"
  exit 0
fi

promtool="${PROMTOOL:-promtool}"
if ! command -v "$promtool" >/dev/null; then
  echo "test.sh: promtool not found: install Debian's prometheus package (e2e/install-deps.sh does) or set PROMTOOL" >&2
  exit 2
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
extract >"$work/meshgate.rules.yaml"
if ! grep -q '^groups:' "$work/meshgate.rules.yaml"; then
  echo "test.sh: no rule groups under spec: in the chart's templates/prometheusrule.yaml" >&2
  exit 2
fi
shopt -s nullglob
tests=("$here"/tests/*.yaml)
if [[ ${#tests[@]} -eq 0 ]]; then
  echo "test.sh: no promtool tests in $here/tests" >&2
  exit 2
fi
# The tests name the rules file relative to themselves: run them beside the extracted copy.
cp "${tests[@]}" "$work/"
cd "$work"
echo "==> promtool check rules (manifests/charts/meshgate/templates/prometheusrule.yaml, rendered)"
"$promtool" check rules meshgate.rules.yaml
echo "==> promtool test rules (manifests/charts/monitoring/tests)"
names=()
for t in "${tests[@]}"; do names+=("$(basename "$t")"); done
"$promtool" test rules "${names[@]}"
