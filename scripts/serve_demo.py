"""`make serve-demo`: train the app's DLRM on 2 x 2, export its tables into a Redis
Cluster, and serve a batch with tfhybrid.serving.Predictor.

Starts a password-protected 3-master / 3-replica cluster on localhost ports
(tfhybrid.testing.redis_cluster), runs `python -m tfhybrid.train` under
`horovodrun -np 4` with `--export_tables=external`, then serves the app's synthetic
eval batch from the export and compares with the all-inline `serving_default`
signature. The cluster and the temporary folder are removed however it ends. About two
minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tfhybrid.testing.redis_cluster import LocalRedisCluster, nodes_arg  # noqa: E402

APP_FLAGS = ["--model=dlrm", "--dataset=synthetic", "--model_parallel=2", "--steps=100",
             "--batch_size=512", "--embedding_dim=8", "--bottom_mlp_dims=16,8",
             "--top_mlp_dims=32,1", "--max_table_rows=20000", "--eval_batches=2"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="float32",
                        choices=("float32", "float16", "int8"))
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="the training job's limit in seconds")
    args = parser.parse_args()
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="serve-demo-") as work, \
            LocalRedisCluster(masters=3, replicas=1) as cluster:
        print(f"serve-demo: Redis Cluster up: {nodes_arg(cluster.nodes)} (3 masters, "
              "3 replicas, password in a file)")
        password_file = os.path.join(work, "password")
        with open(password_file, "w") as f:
            f.write(cluster.password)
        export_dir = os.path.join(work, "dlrm")
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
        command = [os.path.join(os.path.dirname(python), "horovodrun"), "-np", "4", "-H",
                   "localhost:4", "--gloo", python, "-m", "tfhybrid.train", *APP_FLAGS,
                   f"--export_dir={export_dir}", "--export_tables=external",
                   f"--export_precision={args.precision}",
                   f"--redis={nodes_arg(cluster.nodes)}",
                   f"--redis_password_file={password_file}"]
        print("serve-demo: training and exporting on 2 x 2:", " ".join(command[5:]))
        subprocess.run(command, env=env, cwd=ROOT, check=True, timeout=args.timeout)

        import numpy as np
        import tensorflow as tf

        from tfhybrid.serving import Predictor, RedisStore
        from tfhybrid.train.data import make_dataset
        store = RedisStore(cluster.nodes, password=cluster.password,
                           key_prefix=os.path.basename(export_dir))
        predictor = Predictor(export_dir, store)
        (features, _), = make_dataset("synthetic", "eval", global_batch_size=64,
                                      max_table_rows=20000, num_batches=1).take(1)
        batch = {k: v.numpy() for k, v in features.items()}
        began = time.perf_counter()
        served = predictor(batch)["probability"]
        took = time.perf_counter() - began
        inline = tf.saved_model.load(export_dir).signatures["serving_default"](
            **{k: tf.constant(v) for k, v in batch.items()})["probability"].numpy()
        print(f"serve-demo: served 64 requests' scores in {took * 1000:.1f} ms, "
              f"{predictor.stats['rows_fetched']} rows fetched; first scores "
              f"{np.round(served[:4, 0], 4).tolist()}; largest difference to the "
              f"all-inline signature {np.abs(served - inline).max():.2e} ({args.precision})")
        store.close()


if __name__ == "__main__":
    main()
