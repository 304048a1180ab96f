# meshgate: the README's two commands are `make demo` and `make test`.
#
# Both first run e2e/install-deps.sh (once: `deps`), which installs the Debian packages the tests need and
# builds (once, then reuses from ~/.cache/meshgate/...) the Kubernetes control-plane binaries,
# the real node's kubelet, containerd, istio-cni and images, and helm, that the e2e tests and
# the demo run.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
CARGO ?= cargo
DEPS := e2e/install-deps.sh
# The Kubernetes bin dir install-deps.sh prints last: it runs on first use, once per make run
# (its progress goes to stderr), and `deps` fails when it did not succeed.
K8S_BIN_DIR = $(eval K8S_BIN_DIR := $$(shell bash $(DEPS) | tail -n 1))$(K8S_BIN_DIR)
# helm, built by install-deps.sh and linked into that directory.
HELM = $(K8S_BIN_DIR)/helm
# meshgate's own image for the real node (release binaries; e2e/images/build-meshgate-image.sh).
TARGET_DIR = $${CARGO_TARGET_DIR:-target}
IMAGE = $(CARGO) build --release --locked -p meshgate-agent -p meshgate-webhook && \
	bash e2e/images/build-meshgate-image.sh "$(TARGET_DIR)/release" "$(TARGET_DIR)/meshgate-image/meshgate.tar"

.PHONY: test demo deps lint chart alerts images unit check-root bench soak

## test: format, lint, and every test (unit, privileged integration, e2e on a real apiserver)
test: check-root deps lint chart alerts images
	@echo "==> cargo build --bins (the e2e tests run the real agent and webhook binaries)"
	$(CARGO) build --workspace --bins --locked
	@echo "==> meshgate's image for the real node (release build)"
	$(IMAGE)
	@echo "==> cargo test --workspace (unit, integration and e2e)"
	MESHGATE_K8S_BIN_DIR="$(K8S_BIN_DIR)" $(CARGO) test --workspace --locked

## demo: the main job end to end on a local control plane
demo: check-root deps
	@echo "==> building meshgate"
	$(CARGO) build --workspace --locked --bins
	@echo "==> meshgate's image for the real node (release build)"
	$(IMAGE)
	MESHGATE_K8S_BIN_DIR="$(K8S_BIN_DIR)" "$(TARGET_DIR)/debug/meshgate-e2e" demo

## deps: install Debian packages and build/reuse the Kubernetes binaries
deps:
	@test -d "$(K8S_BIN_DIR)" || { echo "make: $(DEPS) failed (see above)" >&2; exit 1; }

## chart: helm lint of the chart, with its default values and with every option on; its README current
chart: deps
	@echo "==> helm lint manifests/charts/meshgate"
	"$(HELM)" lint --strict manifests/charts/meshgate
	"$(HELM)" lint --strict manifests/charts/meshgate --values e2e/chart/all-on-values.yaml
	@# agent.impersonateNode=auto goes by the Kubernetes version: lint renders for Helm's own
	@# (1.36+: the confined ClusterRole) above, and for 1.35 (the cluster-wide one) here.
	"$(HELM)" lint --strict manifests/charts/meshgate --kube-version 1.35.0
	@echo "==> the chart README's values table is current (manifests/charts/meshgate/readme.sh)"
	bash manifests/charts/meshgate/readme.sh --check

## alerts: promtool checks and unit tests of the chart's PrometheusRule
alerts: deps
	@echo "==> promtool check rules / test rules"
	HELM="$(HELM)" bash manifests/charts/monitoring/test.sh

## images: the chart pins meshgate's image by digest; the real node's values run its local build
images: deps
	@echo "==> manifests/charts/images.sh check"
	HELM="$(HELM)" bash manifests/charts/images.sh check

lint:
	@echo "==> cargo fmt --check"
	$(CARGO) fmt --all --check
	@echo "==> cargo clippy --all-targets -D warnings"
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

## bench: latency and cost figures on a local control plane (release build; not part of test)
bench: check-root deps
	$(CARGO) build --release --workspace --bins --locked
	@echo "==> meshgate's image for the real node of the realnode section"
	$(IMAGE)
	MESHGATE_K8S_BIN_DIR="$(K8S_BIN_DIR)" $(CARGO) bench --locked -p meshgate-e2e --bench compare
	$(CARGO) bench --locked -p meshgate-agent --bench inspect_sweep

## soak: the long fault-suite variants and longer fuzzing (not part of test)
soak: check-root deps
	MESHGATE_K8S_BIN_DIR="$(K8S_BIN_DIR)" bash e2e/soak.sh

## unit: the tests that need neither root nor a control plane (libs and core's scenarios)
unit:
	$(CARGO) test --workspace --locked --lib
	$(CARGO) test --locked -p meshgate-core --tests

check-root:
	@if [[ $$(id -u) -ne 0 ]]; then \
	  echo "make: the tests create network namespaces and install packages: run as root" >&2; exit 1; \
	fi
