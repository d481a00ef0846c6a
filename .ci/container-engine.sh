#!/usr/bin/env bash
# A real container engine for the docker backend's tests: podman (runc runtime) behind a Docker-API socket of
# its own, and offline base images made from Debian packages (no registry is needed or reached).
#
#   source .ci/container-engine.sh up  # exports MILES_AGENT_DOCKER_TEST_URL / _IMAGE, MILES_AGENT_TEST_DOCKER, DOCKER_HOST
#   .ci/container-engine.sh stop       # ends the service this script started
#
# Why runc: podman's default crun fails on a cgroup-v1 hybrid layout. Why explicit ulimits: without
# CAP_SYS_RESOURCE podman cannot raise nofile/nproc past the host's hard limit, so its defaults must fit
# under it. Images: mmdebstrap --variant=minbase, then `podman import`; built once, the tarballs cached under
# ~/.cache/miles-agent/images (first run: about 70 s per Debian release, later runs: seconds).
set -euo pipefail

STATE="${MILES_AGENT_ENGINE_DIR:-$HOME/.cache/miles-agent/engine}"
IMAGES="${MILES_AGENT_IMAGE_CACHE:-$HOME/.cache/miles-agent/images}"
SOCK="$STATE/podman.sock"
CONF="$STATE/containers.conf"
mkdir -p "$STATE" "$IMAGES"

engine_stop() {
  if [ -f "$STATE/service.pid" ]; then
    kill "$(cat "$STATE/service.pid")" 2>/dev/null || true
    rm -f "$STATE/service.pid" "$SOCK"
  fi
}

engine_install() {
  local missing=""
  for tool in podman runc mmdebstrap; do command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"; done
  command -v newuidmap >/dev/null 2>&1 || missing="$missing uidmap"
  if [ -n "$missing" ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  fi
}

engine_conf() {
  # Under this shell's hard limits (podman's own defaults are far above them), and under 32768 processes,
  # podman's own cap for the processes it starts.
  local nofile nproc
  nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
  { [ "$nofile" = unlimited ] || [ "$nofile" -gt 65536 ]; } && nofile=65536
  { [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
  cat > "$CONF" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
events_logger = "file"
cgroup_manager = "cgroupfs"
CONF
}

engine_start() {
  export CONTAINERS_CONF="$CONF"
  if [ -S "$SOCK" ] && [ -f "$STATE/service.pid" ] && kill -0 "$(cat "$STATE/service.pid")" 2>/dev/null; then
    return 0
  fi
  rm -f "$SOCK"
  # A unix socket of our own (never TCP): only this machine's users with access to $STATE reach it. Started
  # from / : the service outlives this checkout, and once its working directory is deleted every container
  # start fails ("write child: broken pipe").
  pushd / > /dev/null
  setsid podman --runtime runc system service --time=0 "unix://$SOCK" > "$STATE/service.log" 2>&1 < /dev/null &
  echo $! > "$STATE/service.pid"
  popd > /dev/null
  for _ in $(seq 1 100); do [ -S "$SOCK" ] && return 0; sleep 0.1; done
  echo "container-engine: podman service did not create $SOCK; see $STATE/service.log" >&2
  return 1
}

# Sites whose TLS goes through an intercepting proxy (a corporate CA in the host's bundle):
# MILES_AGENT_IMAGE_CA=BUNDLE makes the stand-in images trust what the host trusts. BUNDLE replaces their
# system bundle and pip, requests, curl, uv and node are pointed at it, so a task's `RUN pip install` or a
# solve.sh's `pip install` reaches the package registry as the host does. Unset: images as Debian ships them.
CA_BUNDLE="${MILES_AGENT_IMAGE_CA:-}"
# Kept where update-ca-certificates (run by any apt install that pulls ca-certificates) adds it back into the
# system bundle it regenerates; the clients' variables point at this copy, which nothing regenerates.
CA_ENV="/usr/local/share/ca-certificates/miles-host-bundle.crt"
ca_label() { if [ -n "$CA_BUNDLE" ]; then { sha256sum "$CA_BUNDLE"; echo "$CA_ENV"; } | sha256sum | cut -c1-16; fi; }
ca_current() {  # IMAGE: does it carry the trust asked for (none asked: any image will do)?
  [ -z "$CA_BUNDLE" ] && return 0
  [ "$(podman image inspect --format '{{index .Labels "miles.ca"}}' "$1" 2>/dev/null)" = "$(ca_label)" ]
}
ca_commit_changes() {  # the --change flags that point every client at the bundle
  printf '%s\n' --change "LABEL miles.ca=$(ca_label)" --change "ENV SSL_CERT_FILE=$CA_ENV" \
    --change "ENV PIP_CERT=$CA_ENV" --change "ENV REQUESTS_CA_BUNDLE=$CA_ENV" --change "ENV CURL_CA_BUNDLE=$CA_ENV" \
    --change "ENV NODE_EXTRA_CA_CERTS=$CA_ENV" --change "ENV UV_NATIVE_TLS=1"
}
trust_ca() {  # IMAGE: replace its system bundle with CA_BUNDLE, committed under the same name
  [ -z "$CA_BUNDLE" ] && return 0
  local cid changes
  cid=$(podman create "$1" true)
  podman cp "$CA_BUNDLE" "$cid:$CA_ENV"
  podman cp "$CA_BUNDLE" "$cid:/etc/ssl/certs/ca-certificates.crt"
  mapfile -t changes < <(ca_commit_changes)
  podman commit --quiet "${changes[@]}" "$cid" "$1" >/dev/null
  podman rm "$cid" >/dev/null
}

# make_image SUITE TARBALL-NAME PACKAGES TAG...: one Debian root filesystem, imported once, tagged as named.
make_image() {
  local suite=$1 name=$2 packages=$3; shift 3
  local first=$1
  if ! podman image exists "$first" || ! ca_current "$first"; then
    if [ ! -s "$IMAGES/$name.tar" ]; then
      echo "container-engine: building $name from Debian $suite (about 70 s, once)" >&2
      mmdebstrap --quiet --variant=minbase --include="$packages" "$suite" "$IMAGES/$name.part.tar"
      mv "$IMAGES/$name.part.tar" "$IMAGES/$name.tar"
    fi
    podman import --quiet \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' --change 'CMD ["bash"]' "$IMAGES/$name.tar" "$first" >/dev/null
    trust_ca "$first"
    for tag in "$@"; do podman tag "$first" "$tag"; done  # moves tags left on an older import
  fi
  for tag in "$@"; do
    podman image exists "$tag" || podman tag "$first" "$tag"
  done
}

engine_images() {
  export CONTAINERS_CONF="$CONF"
  local pkgs="python3,python3-venv,python3-pip,python-is-python3,bash,coreutils,procps,ca-certificates,tar,gzip,curl"
  # Debian 13 (trixie) ships Python 3.13: the names tasks use for a 3.13 slim image and Terminal-Bench's
  # python-3-13 base. Debian 12 (bookworm) ships 3.11. No Debian release ships 3.12 (see engine_python312);
  # ubuntu:* comes from engine_ubuntu, on request.
  # Tagged with the fully qualified names Docker resolves short names to (FROM python:3.13-slim is
  # docker.io/library/python:3.13-slim), so builds find them locally and never try a registry.
  # python:3.13-slim-bookworm gets the trixie image: the Python tasks ask for, on a newer Debian.
  local lib=docker.io/library
  make_image trixie miles-debian-trixie "$pkgs" localhost/miles-agent/trixie-python3.13:latest \
    $lib/python:3.13-slim $lib/python:3.13-slim-trixie $lib/python:3.13-slim-bookworm $lib/python:3.13 \
    $lib/debian:trixie $lib/debian:trixie-slim \
    ghcr.io/laude-institute/t-bench/python-3-13:20250620 ghcr.io/laude-institute/t-bench/python-3-13:latest
  make_image bookworm miles-debian-bookworm "$pkgs" localhost/miles-agent/bookworm-python3.11:latest \
    $lib/python:3.11-slim $lib/python:3.11-slim-bookworm $lib/python:3.11 $lib/debian:bookworm \
    $lib/debian:bookworm-slim
}

# python:3.12-slim is Debian bookworm with CPython 3.12 compiled on it; no Debian release packages 3.12, but a
# pyenv build of it on this Debian 12 machine is exactly that. Copied in at its own prefix (its rpath), put
# first on PATH; skipped (tasks on python:3.12-* then say to load the image) when no such build is here.
engine_python312() {
  export CONTAINERS_CONF="$CONF"
  local lib=docker.io/library prefix
  podman image exists $lib/python:3.12-slim && ca_current $lib/python:3.12-slim && return 0
  prefix=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.* 2>/dev/null | tail -1)
  if [ -z "$prefix" ] || [ ! -x "$prefix/bin/python3.12" ]; then
    echo "container-engine: no CPython 3.12 build here; python:3.12-slim not made" >&2
    return 0
  fi
  local stage cid
  stage=$(mktemp -d)
  mkdir -p "$stage$(dirname "$prefix")"
  cp -a "$prefix" "$stage$prefix"
  # Only CPython and pip: nothing this machine added to its site-packages.
  find "$stage$prefix/lib/python3.12/site-packages" -maxdepth 1 -name '*.pth' -delete
  rm -rf "$stage$prefix/lib/python3.12/test"
  cid=$(podman create localhost/miles-agent/bookworm-python3.11:latest true)
  podman cp "$stage/." "$cid:/"
  podman commit --quiet \
    --change "ENV PATH=$prefix/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' --change 'CMD ["bash"]' \
    "$cid" localhost/miles-agent/bookworm-python3.12:latest >/dev/null
  podman rm "$cid" >/dev/null
  rm -rf "$stage"
  for tag in $lib/python:3.12-slim $lib/python:3.12-slim-bookworm $lib/python:3.12; do
    podman tag localhost/miles-agent/bookworm-python3.12:latest "$tag"
  done
}

# ubuntu:24.04, opt-in (MILES_AGENT_UBUNTU_IMAGES=1; the test suite needs neither): many public
# Terminal-Bench tasks build FROM ubuntu. Made as Docker's ubuntu image is made, from the Ubuntu archive
# (reachable here, unlike a registry): minbase, no python3, no CA bundle. The archive's signing keys come from
# Ubuntu's own ubuntu-keyring package, checked against the sha256 pinned here (Debian 12 does not ship it).
# Not 22.04: jammy's InRelease is now signed by a key (871920D1991BC93C) that no keyring here carries.
UBUNTU_KEYRING_DEB="http://archive.ubuntu.com/ubuntu/pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb"
UBUNTU_KEYRING_SHA256="36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8"
ubuntu_keyring() {  # prints the path of the archive keyring, fetched and checked once
  local dir="$IMAGES/ubuntu-keyring"
  if [ ! -s "$dir/ubuntu-archive-keyring.gpg" ]; then
    mkdir -p "$dir"
    curl -fsS -o "$dir/keyring.deb" "$UBUNTU_KEYRING_DEB"
    echo "$UBUNTU_KEYRING_SHA256  $dir/keyring.deb" | sha256sum --check --quiet
    dpkg-deb --fsys-tarfile "$dir/keyring.deb" | tar -xO ./usr/share/keyrings/ubuntu-archive-keyring.gpg \
      > "$dir/ubuntu-archive-keyring.gpg"
  fi
  # apt reads it as its unprivileged _apt user, which cannot enter a private home: a world-readable copy.
  local copy
  copy=$(mktemp -d)
  chmod 755 "$copy"
  install -m 644 "$dir/ubuntu-archive-keyring.gpg" "$copy/"
  echo "$copy/ubuntu-archive-keyring.gpg"
}
engine_ubuntu() {
  export CONTAINERS_CONF="$CONF"
  local lib=docker.io/library keyring release version name first
  keyring=$(ubuntu_keyring)
  for pair in noble:24.04; do
    release=${pair%%:*} version=${pair#*:} name=miles-ubuntu-$release first=localhost/miles-agent/ubuntu-$version:latest
    if ! podman image exists "$first" || ! ca_current "$first"; then
      if [ ! -s "$IMAGES/$name.tar" ]; then
        echo "container-engine: building $name from the Ubuntu archive (several minutes, once)" >&2
        mmdebstrap --quiet --variant=minbase --include=apt,ubuntu-keyring,gpgv --keyring="$keyring" \
          --components=main,universe "$release" \
          "$IMAGES/$name.part.tar" http://archive.ubuntu.com/ubuntu
        mv "$IMAGES/$name.part.tar" "$IMAGES/$name.tar"
      fi
      podman import --quiet --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' "$IMAGES/$name.tar" "$first" >/dev/null
      trust_ca "$first"
    fi
    for tag in $lib/ubuntu:$version $lib/ubuntu:$release; do podman tag "$first" "$tag"; done
  done
  rm -rf "$(dirname "$keyring")"
  # Terminal-Bench's own Ubuntu base (TermiGen-style tasks build FROM it), as python-3-13 is tagged above.
  for tag in $lib/ubuntu:latest ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624 \
      ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest; do
    podman tag localhost/miles-agent/ubuntu-24.04:latest "$tag"
  done
}

# For tasks that name no image (they need only host tools): the trixie image plus the tools such tasks
# use that a slim image lacks (git, jq, ...). Pass it as the docker sandbox's `image` option.
engine_tools_image() {
  export CONTAINERS_CONF="$CONF"
  local tag=localhost/miles-agent/task-tools:latest ctx
  podman image exists $tag && ca_current $tag && return 0
  ctx=$(mktemp -d)
  printf '%s\n' 'FROM localhost/miles-agent/trixie-python3.13:latest' \
    'RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends git jq less file unzip zip xz-utils bc sqlite3 >/dev/null && rm -rf /var/lib/apt/lists/*' \
    > "$ctx/Dockerfile"
  podman build --quiet --tag $tag "$ctx" >/dev/null
  rm -rf "$ctx"
}

case "${1:-up}" in
  stop) engine_stop ;;
  up|"")
    engine_install
    engine_conf
    engine_start
    engine_images
    engine_python312
    engine_tools_image
    if [ "${MILES_AGENT_UBUNTU_IMAGES:-0}" = 1 ]; then engine_ubuntu; fi
    export MILES_AGENT_DOCKER_TEST_URL="unix://$SOCK"
    export MILES_AGENT_DOCKER_TEST_IMAGE="localhost/miles-agent/trixie-python3.13:latest"
    # The shared remote-backend contract suite too (tests/sandboxes/test_remote_contract.py).
    export MILES_AGENT_TEST_DOCKER=1 DOCKER_HOST="unix://$SOCK"
    echo "container-engine: podman at $MILES_AGENT_DOCKER_TEST_URL, test image $MILES_AGENT_DOCKER_TEST_IMAGE" >&2
    ;;
  *) echo "usage: $0 [up|stop]" >&2; exit 2 ;;
esac
