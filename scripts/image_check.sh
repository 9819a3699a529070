#!/usr/bin/env bash
# Build the pdserve image for real and run the stack inside it (docs/deploy.md).
#
#   bash scripts/image_check.sh [WORKDIR]      # default WORKDIR: a new temp folder
#
# No image registry is reachable here, so the base is made locally: debootstrap a minimal
# bookworm from the machine's Debian mirror, add the host's CA certificates (HTTPS from the
# build is refused without them), `docker import` it, and build the Dockerfile on it
# (BASE_IMAGE build arg) with torch from the machine's local CPU wheel (docker/wheels/).
# Then `pdserve up --prefill 1 --decode 1 --transfer-backend mooncake` runs in the image and
# one chat completion goes through the router; each node must run the prebuilt kernels. Exit status != 0 on any failure; the phase
# timings are printed at the end. tests/helm/test_image.py checks that this script and the
# Dockerfile agree (base arg, extras, wheel folder).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d /tmp/pdserve-image.XXXXXX)}
BASE_TAG=pdserve-base:bookworm
IMAGE=pdserve:image-check
EXTRAS=mooncake
TORCH_VERSION=2.13.0
DOCKERD_PID=""
TIMINGS=()
T0=$(date +%s)
mkdir -p "$WORK"

phase() {  # phase NAME: close the previous phase's timing, announce the next
    local now; now=$(date +%s)
    [ -n "${PHASE:-}" ] && TIMINGS+=("$(printf '%-14s %5ds' "$PHASE" $((now - PHASE_T)))")
    PHASE=$1; PHASE_T=$now
    [ "$1" = done ] || echo "== image_check: $1"
}

cleanup() {
    local rc=$?
    phase done
    echo "== image_check timings (total $(( $(date +%s) - T0 ))s):"
    printf '   %s\n' "${TIMINGS[@]}"
    if [ -n "$DOCKERD_PID" ]; then kill "$DOCKERD_PID" 2>/dev/null; wait "$DOCKERD_PID" || true; fi
    [ $rc -eq 0 ] && echo "image_check: OK" || echo "image_check: FAILED (exit $rc)"
    exit $rc
}
trap cleanup EXIT

phase tools
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${need[@]}" >/dev/null \
        || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y "${need[@]}" >/dev/null; }
fi
if ! docker info >/dev/null 2>&1; then  # start our own daemon; stopped by pid on exit
    dockerd >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log"; exit 1; }
fi

phase debootstrap
# The machine's Debian mirror: first URIs:/deb line of the apt sources that is not security.
MIRROR=$({ cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null || true; } \
    | sed -n -E 's/^URIs:[[:space:]]*([^[:space:]]+).*/\1/p; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' \
    | grep -v security | head -1 || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ROOTFS=$WORK/rootfs
if [ ! -x "$ROOTFS/bin/bash" ]; then
    rm -rf "$ROOTFS"
    debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log"; exit 1; }
fi
# The host's trusted CAs: as the bundle now, and as a local CA that update-ca-certificates
# keeps when the Dockerfile installs ca-certificates.
mkdir -p "$ROOTFS/etc/ssl/certs" "$ROOTFS/usr/local/share/ca-certificates"
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/usr/local/share/ca-certificates/host.crt"
tar -C "$ROOTFS" -c . | docker import - "$BASE_TAG" >/dev/null

phase context
CTX=$WORK/context
rm -rf "$CTX" && mkdir -p "$CTX"
(cd "$REPO" && git ls-files -co --exclude-standard -z | tar --null -T - -c) | tar -C "$CTX" -x
# torch: the local CPU wheel pip takes on this machine (its find-links folder).
FIND_LINKS=$(pip config list 2>/dev/null | sed -n -E "s/.*find-links='([^']*)'.*/\1/p" | head -1)
WHEEL=$(ls "${FIND_LINKS:-/nonexistent}"/torch-"$TORCH_VERSION"*cp311*.whl 2>/dev/null | head -1 || true)
if [ -n "$WHEEL" ]; then
    cp "$WHEEL" "$CTX/docker/wheels/"
    echo "   torch wheel: $WHEEL"
else
    echo "   no local torch wheel: the build downloads it from the CPU index"
fi

phase build
DOCKER_BUILDKIT=0 docker build --build-arg BASE_IMAGE="$BASE_TAG" --build-arg EXTRAS="$EXTRAS" \
    --build-arg TORCH_VERSION="$TORCH_VERSION" -t "$IMAGE" "$CTX" >"$WORK/build.log" 2>&1 \
    || { tail -40 "$WORK/build.log"; exit 1; }
grep -E '^(Step |Successfully)' "$WORK/build.log" | cut -c1-110 || true
docker image ls "$IMAGE" --format '   image {{.Repository}}:{{.Tag}} {{.Size}}'

phase run
docker run --rm "$IMAGE" bash -c '
set -e
pdserve up --model smollm2-135m --prefill 1 --decode 1 --transfer-backend mooncake --port 8000 \
    --registry-port 8998 --log-dir /tmp/logs > /tmp/up.log 2>&1 &
UP=$!
for _ in $(seq 600); do grep -q "ready in" /tmp/up.log && break
    kill -0 $UP 2>/dev/null || { cat /tmp/up.log; exit 1; }; sleep 1; done
grep -q "ready in" /tmp/up.log || { cat /tmp/up.log; tail -30 /tmp/logs/*; exit 1; }
cat /tmp/up.log
python - <<EOF
import httpx
nodes = httpx.get("http://127.0.0.1:8998/v1/nodes").json()["nodes"]
backends = {n["node_id"]: n["transfer_backend"] for n in nodes}
print("nodes:", backends)
assert len(backends) == 2 and set(backends.values()) == {"mooncake"}, backends
# Each node runs the fused kernels the builder stage compiled for the ISA level this CPU runs.
for n in nodes:
    eng = httpx.get(n["http_url"] + "/server_info").json()["engine"]
    print(n["node_id"], "kernels:", eng["kernels"], eng["kernels_build"])
    assert eng["kernels"] == "native", eng
    assert (eng["kernels_build"] or "").startswith("prebuilt-"), eng
body = {"model": "smollm2-135m", "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
r = httpx.post("http://127.0.0.1:8000/v1/chat/completions", json=body, timeout=300)
print("status", r.status_code, r.text[:600])
r.raise_for_status()
out = r.json()
answer = out["choices"][0]["message"]["content"]
assert answer.strip() and out["usage"]["completion_tokens"] > 0, out
print("answer:", repr(answer))
EOF
kill -TERM $UP; wait $UP || echo "pdserve up exited $?"
'
