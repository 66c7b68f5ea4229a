#!/usr/bin/env bash
# One-command, idempotent setup: system packages, a venv, the pinned Python stack,
# horovod built from source, and the tfhybrid custom-op library.
# A second run checks a stamp and finishes in seconds.
#   TF=2.21 (default): requirements.txt into .venv
#   TF=2.15:           requirements-tf2.15.txt into .venv-tf2.15
# VENV overrides the venv's path.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TF_STACK="${TF:-2.21}"
case "$TF_STACK" in
  2.21) REQUIREMENTS=requirements.txt; DEFAULT_VENV=.venv ;;
  2.15) REQUIREMENTS=requirements-tf2.15.txt; DEFAULT_VENV=.venv-tf2.15 ;;
  *) echo "setup: TF=$TF_STACK is not a supported stack; expected 2.21 (default) or 2.15" >&2
     exit 2 ;;
esac
VENV="${VENV:-$DEFAULT_VENV}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="${PYTHON:-python3}"
step() { CURRENT_STEP="$1"; echo "==> setup (TF $TF_STACK, $VENV): $1"; }
trap 'echo "setup FAILED during step: ${CURRENT_STEP:-start}" >&2' ERR

HOROVOD_FLAGS="HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1"
if command -v mpirun >/dev/null 2>&1 && [ -e /usr/include/x86_64-linux-gnu/openmpi ] || [ -n "${TFHYBRID_WITH_MPI:-}" ]; then
  HOROVOD_FLAGS="$HOROVOD_FLAGS HOROVOD_WITH_MPI=1"
else
  HOROVOD_FLAGS="$HOROVOD_FLAGS HOROVOD_WITHOUT_MPI=1"
fi

# The stamp covers everything whose change must trigger a re-install, this checkout's
# path too: the editable install points at it, so a venv set up from another checkout
# (or a copy) is installed again here.
stamp_inputs() {
  cat "$REQUIREMENTS" pyproject.toml setup.py scripts/setup.sh tfhybrid/custom_ops/flags.bzl
  pwd -P
  echo "$HOROVOD_FLAGS"
  find tfhybrid/custom_ops/cc -type f \( -name '*.cc' -o -name '*.h' \) -print0 2>/dev/null | sort -z | xargs -0 cat 2>/dev/null || true
}
STAMP_WANT=$(stamp_inputs | sha256sum | cut -c1-16)
if [ -f "$VENV/.tfhybrid-setup" ] && [ "$(cat "$VENV/.tfhybrid-setup")" = "$STAMP_WANT" ]; then
  echo "setup: up to date ($STAMP_WANT)"
  exit 0
fi

step "system packages (g++, cmake, make; iproute2 and openssh for the emulated cluster; redis)"
# command -> Debian package; the emulated multi-node cluster (tfhybrid/testing/cluster.py)
# needs ip, tc, ssh, ssh-keygen and sshd; serving's tests and demo start a Redis Cluster
# (tfhybrid/testing/redis_cluster.py) and its benchmark runs redis-benchmark
missing=()
for pair in g++:g++ cmake:cmake make:make ip:iproute2 tc:iproute2 ssh:openssh-client \
            ssh-keygen:openssh-client /usr/sbin/sshd:openssh-server \
            redis-server:redis-server redis-cli:redis-tools redis-benchmark:redis-tools; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then echo "need root to apt-get install: ${missing[*]}" >&2; false; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    $(printf '%s\n' "${missing[@]}" | sort -u)
fi
# horovod's gloo build rejects CMake 4 unless told the policy floor.
export CMAKE_POLICY_VERSION_MINIMUM=3.5

step "virtualenv $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade "pip>=23.2" wheel setuptools

step "pinned Python stack"
grep -v '^horovod' "$REQUIREMENTS" > "$VENV/requirements-nohorovod.txt"
"$VPY" -m pip install -q -r "$VENV/requirements-nohorovod.txt"

step "horovod from its sdist, patched ($HOROVOD_FLAGS)"
HVD_VERSION=$(grep '^horovod==' "$REQUIREMENTS" | cut -d= -f3)
# pip's wheel cache would reuse a wheel built with other HOROVOD_* flags, so wheels
# live in a folder keyed by the flags, the TF version and the patch.
HVD_PATCH="drop-xla_mpi_ops"
WHEEL_KEY=$(echo "$HVD_VERSION $HOROVOD_FLAGS $HVD_PATCH tf$("$VPY" -c 'import tensorflow as tf;print(tf.__version__)' 2>/dev/null)" | sha256sum | cut -c1-12)
WHEEL_DIR="${TFHYBRID_WHEEL_DIR:-$HOME/.cache/tfhybrid/wheels}/horovod-$WHEEL_KEY"
have_hvd=$("$VPY" -c 'import horovod,sys;print(horovod.__version__)' 2>/dev/null || true)
if [ "$have_hvd" != "$HVD_VERSION" ] || [ ! -f "$VENV/.horovod-$WHEEL_KEY" ]; then
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    mkdir -p "$WHEEL_DIR"
    SRC=$(mktemp -d)
    "$VPY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$SRC" \
      "horovod==$HVD_VERSION"
    tar xzf "$SRC/horovod-$HVD_VERSION.tar.gz" -C "$SRC"
    # The whole patch: horovod 0.28.1 (its last release) has one source that does not
    # build against TF >= 2.19, its XLA ops (xla_mpi_ops.cc, registered only with
    # HOROVOD_ENABLE_XLA_OPS=1; tfhybrid does not use them): it includes
    # tensorflow/compiler/xla/client/xla_builder.h, which TF moved, and highwayhash
    # headers TF's wheel does not ship. Dropped for every TF, so one recipe builds both.
    CMAKELISTS="$SRC/horovod-$HVD_VERSION/horovod/tensorflow/CMakeLists.txt"
    grep -q 'xla_mpi_ops\.cc' "$CMAKELISTS" || { echo "horovod's sdist changed: no xla_mpi_ops.cc in $CMAKELISTS" >&2; false; }
    sed -i '/xla_mpi_ops\.cc/d' "$CMAKELISTS"
    env $HOROVOD_FLAGS MAKEFLAGS="-j$(nproc)" "$VPY" -m pip wheel -q --no-deps --no-build-isolation \
      --no-cache-dir -w "$WHEEL_DIR" "$SRC/horovod-$HVD_VERSION"
    rm -rf "$SRC"
  fi
  "$VPY" -m pip install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
  # horovod's own runtime deps (cloudpickle, psutil, pyyaml, packaging, cffi).
  "$VPY" -m pip install -q "horovod==$HVD_VERSION" --no-build-isolation --find-links "$WHEEL_DIR" --no-index 2>/dev/null \
    || "$VPY" -m pip install -q cloudpickle psutil pyyaml packaging "cffi>=1.4.0"
  touch "$VENV/.horovod-$WHEEL_KEY"
fi

step "tfhybrid (editable) and its custom-op library"
"$VPY" -m pip install -q --no-deps --no-build-isolation -e .
"$VPY" -m tfhybrid.custom_ops.build

step "check: horovodrun --check-build shows TensorFlow and Gloo"
check=$("$VENV/bin/horovodrun" --check-build)
echo "$check"
echo "$check" | grep -q '\[X\] TensorFlow' || { echo "horovod was built without TensorFlow" >&2; false; }
echo "$check" | grep -q '\[X\] Gloo' || { echo "horovod was built without Gloo" >&2; false; }

step "check: pip check"
"$VPY" -m pip check

echo "$STAMP_WANT" > "$VENV/.tfhybrid-setup"
echo "setup: done"
