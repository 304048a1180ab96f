# syntax=docker/dockerfile:1
#
# meshgate: one image with its binaries, /usr/local/bin/meshgate-agent,
# /usr/local/bin/meshgate-webhook (the chart's templates pick one with `command`) and
# /usr/local/bin/kubectl-meshgate (the kubectl plugin; the chart's uninstall hook runs its
# `cleanup`).
#
#   docker build -t REGISTRY/meshgate:TAG .
#
# Build: the Rust toolchain pinned in rust-toolchain.toml (checked below), on Debian 12. The
# binaries link no C library beyond glibc's.
# Runtime: distroless cc (glibc, libgcc_s, libm; no shell, no package manager) plus exactly the
# other shared libraries `ldd` reports for the binaries (e2e/images/meshgate-files.sh).

ARG RUST_VERSION=1.95.0

FROM docker.io/library/rust:${RUST_VERSION}-slim-bookworm AS build
ARG RUST_VERSION
WORKDIR /src
COPY . .
# The image's toolchain is the pinned one; refuse to build if they drifted apart. Using it
# directly keeps rustup from downloading rustfmt/clippy, which the build does not need.
ENV RUSTUP_TOOLCHAIN=${RUST_VERSION}
RUN grep -Eq "^channel *= *\"${RUST_VERSION}\"" rust-toolchain.toml \
 || { echo "RUST_VERSION=${RUST_VERSION} does not match rust-toolchain.toml" >&2; exit 1; }
# Then the binaries (the agent crate's two: meshgate-agent and kubectl-meshgate) and every
# shared library they need that distroless/cc lacks (today: none),
# laid out as in the image by e2e/images/meshgate-files.sh: the same script lays
# out the image the real-node tests import (e2e/images/build-meshgate-image.sh), so both hold
# the same files.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p meshgate-agent -p meshgate-webhook \
 && bash e2e/images/meshgate-files.sh /out target/release/meshgate-agent target/release/meshgate-webhook \
      target/release/kubectl-meshgate \
 && find /out -type f | sort

FROM gcr.io/distroless/cc-debian12
# /usr/local/bin/{meshgate-agent,meshgate-webhook,kubectl-meshgate} and /usr/lib/<libraries>
# (on the dynamic loader's default search path on every architecture).
COPY --from=build /out/ /
# The agent runs as root with three capabilities (manifests/charts/meshgate/templates/agent.yaml); the
# webhook Deployment and the cleanup Job set runAsUser 65532 (distroless's "nonroot").
ENTRYPOINT ["/usr/local/bin/meshgate-agent"]
