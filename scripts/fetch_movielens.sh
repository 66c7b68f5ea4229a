#!/usr/bin/env bash
# Downloads MovieLens-100k (from the recbole 1.2.1 wheel on PyPI) for the training app and
# prints the folder. Idempotent. Usage: scripts/fetch_movielens.sh [DATA_DIR]
# (default: $TFHYBRID_DATA_DIR/ml-100k, else ~/.cache/tfhybrid/data/ml-100k).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m tfhybrid.train.data --fetch movielens ${1:+--data_dir "$1"}
