# syntax=docker/dockerfile:1
#
# meshgate: one image with both binaries, /usr/local/bin/meshgate-agent and
# /usr/local/bin/meshgate-webhook (the manifests pick one with `command`).
#
#   docker build -t REGISTRY/meshgate:TAG .
#
# Build: the Rust toolchain pinned in rust-toolchain.toml (checked below), on Debian 12, with
# the C libraries the agent links (libmnl; libnftnl for the nftnl crate's -sys build).
# Runtime: distroless cc (glibc, libgcc_s, libm; no shell, no package manager) plus exactly the
# other shared libraries `ldd` reports for the two binaries, copied from the build stage.

ARG RUST_VERSION=1.95.0

FROM docker.io/library/rust:${RUST_VERSION}-slim-bookworm AS build
ARG RUST_VERSION
RUN apt-get update \
 && apt-get install -y --no-install-recommends pkg-config libmnl-dev libnftnl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The image's toolchain is the pinned one; refuse to build if they drifted apart. Using it
# directly keeps rustup from downloading rustfmt/clippy, which the build does not need.
ENV RUSTUP_TOOLCHAIN=${RUST_VERSION}
RUN grep -Eq "^channel *= *\"${RUST_VERSION}\"" rust-toolchain.toml \
 || { echo "RUST_VERSION=${RUST_VERSION} does not match rust-toolchain.toml" >&2; exit 1; }
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p meshgate-agent -p meshgate-webhook \
 && mkdir -p /out/bin /out/lib \
 && cp target/release/meshgate-agent target/release/meshgate-webhook /out/bin/
# Every shared library the binaries need that distroless/cc lacks (today: libmnl.so.0).
RUN set -eu; \
    for lib in $(ldd /out/bin/meshgate-agent /out/bin/meshgate-webhook | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u); do \
      case "$(basename "$lib")" in \
        libc.so.*|libm.so.*|libgcc_s.so.*|ld-linux*|libdl.so.*|libpthread.so.*|librt.so.*) ;; \
        *) cp -L "$lib" /out/lib/ ;; \
      esac; \
    done; \
    ls -l /out/lib

FROM gcr.io/distroless/cc-debian12
# /usr/lib is in the dynamic loader's default search path on every architecture.
COPY --from=build /out/lib/ /usr/lib/
COPY --from=build /out/bin/ /usr/local/bin/
# The agent runs as root with three capabilities (manifests/base/agent.yaml); the webhook
# Deployment sets runAsUser 65532 (distroless's "nonroot").
ENTRYPOINT ["/usr/local/bin/meshgate-agent"]
