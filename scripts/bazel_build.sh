#!/usr/bin/env bash
# Bazel build of tfhybrid (offline): bazel build //:tfhybrid_ops //:tfhybrid, then load the
# built op library with TensorFlow and list the ops it registers. Idempotent.
#   bash scripts/bazel_build.sh           # incremental
#   bash scripts/bazel_build.sh --cold    # bazel clean --expunge first (cold build)
# Env: TFHYBRID_BAZEL_NATIVE=1 adds --config=native (-march=native, as build.py does with TFHYBRID_MARCH_NATIVE=1; the default is portable);
#      BAZEL_ARGS="..." extra build flags. Installs Debian's bazel-bootstrap if no bazel.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY="${TFHYBRID_PYTHON:-$ROOT/.venv/bin/python}"  # the venv whose TF it builds against
step() { CURRENT_STEP="$1"; echo "==> bazel_build: $1"; }
trap 'echo "bazel_build FAILED during step: ${CURRENT_STEP:-start}" >&2' ERR

COLD=0
for a in "$@"; do
  case "$a" in
    --cold) COLD=1 ;;
    *) echo "usage: $0 [--cold]" >&2; exit 2 ;;
  esac
done

step "install bazel (apt: bazel-bootstrap) if missing"
if ! command -v bazel >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then echo "bazel missing and not root: cannot apt-get install bazel-bootstrap" >&2; false; fi
  step "apt-get update"
  apt-get update -qq
  step "apt-get install bazel-bootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bazel-bootstrap g++
  command -v bazel >/dev/null
fi
step "bazel version"
BAZEL_VERSION="$(bazel --version 2>/dev/null) (deb bazel-bootstrap $(dpkg-query -W -f='${Version}' bazel-bootstrap 2>/dev/null || echo '?'))"
echo "$BAZEL_VERSION"

step "locate TensorFlow (.venv/bin/python, tf.sysconfig)"
if [ ! -x "$PY" ]; then echo "$PY missing: run 'make setup' first" >&2; false; fi
read -r TF_INCLUDE_DIR TF_LIB_DIR < <("$PY" -c 'import tensorflow as tf; print(tf.sysconfig.get_include(), tf.sysconfig.get_lib())' 2>/dev/null | tail -n1)
[ -f "$TF_INCLUDE_DIR/tensorflow/core/framework/op.h" ] || { echo "no TF headers under '$TF_INCLUDE_DIR'" >&2; false; }
echo "TF include: $TF_INCLUDE_DIR"
echo "TF lib:     $TF_LIB_DIR"

FLAGS=(--repo_env="TF_INCLUDE_DIR=$TF_INCLUDE_DIR" --repo_env="TF_LIB_DIR=$TF_LIB_DIR" --repo_env="TF_PYTHON=$PY")
if [ "${TFHYBRID_BAZEL_NATIVE:-0}" = 1 ]; then FLAGS+=(--config=native); fi
# shellcheck disable=SC2206
FLAGS+=(${BAZEL_ARGS:-})

if [ "$COLD" = 1 ]; then
  step "bazel clean --expunge (cold build)"
  nice -n 10 bazel clean --expunge
fi

step "bazel build //:tfhybrid_ops //:tfhybrid"
T0=$(date +%s.%N)
nice -n 10 bazel build "${FLAGS[@]}" //:tfhybrid_ops //:tfhybrid
T1=$(date +%s.%N)
BUILD_SECS=$(awk -v a="$T0" -v b="$T1" 'BEGIN { printf "%.1f", b - a }')

SO="$ROOT/bazel-bin/tfhybrid/custom_ops/_tfhybrid_ops.so"
step "load $SO with TensorFlow"
[ -f "$SO" ] || { echo "$SO was not built" >&2; false; }
TF_CPP_MIN_LOG_LEVEL=3 "$PY" - "$SO" <<'PYEOF'
import sys
import tensorflow as tf
from tensorflow.core.framework import op_def_pb2
from tensorflow.python.client import pywrap_tf_session as py_tf
tf.load_op_library(sys.argv[1])  # the check that matters: the library loads
handle = py_tf.TF_LoadLibrary(sys.argv[1])  # already loaded: same handle; read its OpList
op_list = op_def_pb2.OpList.FromString(py_tf.TF_GetOpList(handle))
py_tf.TF_DeleteLibraryHandle(handle)
ops = sorted(op.name for op in op_list.op)
if not ops:
    sys.exit("the library registers no ops")
print("registered ops (%d): %s" % (len(ops), ", ".join(ops)))
PYEOF

echo "bazel_build: OK ($BAZEL_VERSION; bazel build wall time ${BUILD_SECS}s$([ "$COLD" = 1 ] && echo ', cold'))"
