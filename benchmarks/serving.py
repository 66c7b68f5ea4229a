"""Serving: request latency with external tables against the all-inline SavedModel, and
the export's write rate against redis-benchmark, in the same run on a local Redis Cluster.

One run starts a password-protected 3-master / 3-replica cluster
(tfhybrid.testing.redis_cluster) and:

1. **latency**: trains the app's DLRM on 2 x 2 (horovodrun, synthetic data), exports it
   with every table inline and with external tables in float32, float16 and int8, then,
   in one plain process, serves the same requests of batch 1, 64 and 512 through
   ``tfhybrid.serving.Predictor`` (external; with its default row cache, empty at the
   start of each of three rounds per batch size, and float32 also with none) and the SavedModel's
   ``serving_default`` (inline), the arms interleaved request by request: p50 / p99
   latency and requests/s (one client, requests back to back), the share of rows the
   cache served, and each precision's AUC on the eval split;
   the same training and exports on MovieLens-100k for the AUC of each precision;
2. **export rate**: a ``DistributedEmbedding`` with one row-wise table of ``--rows`` rows
   of width 16 on 2 x 2, exported with ``tables="external"``: rows/s and MB/s per writing
   rank (the first replica of each position writes its shard), and
   ``redis-benchmark --cluster -P 64`` SETs of the same value size (64 bytes) on the same
   cluster right after (three runs, their median).

Results: ``benchmarks/results/serving/results.txt`` and ``results.json`` (``--quick``: a
scratch folder), each with its provenance header.

Usage: .venv/bin/python benchmarks/serving.py [--quick] [--rows N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402  (puts this checkout first on sys.path)

from tfhybrid.testing import provenance  # noqa: E402
from tfhybrid.testing.redis_cluster import LocalRedisCluster, nodes_arg  # noqa: E402

PRECISIONS = ("float32", "float16", "int8")
BATCHES = (1, 64, 512)
# latency rounds per batch size, each from empty row caches: figures are their medians
ROUNDS = 3
WIDTH = 16
MAX_TABLE_ROWS = 100_000


# ---------------------------------------------------------------------------- workers
def _store(args: argparse.Namespace, prefix: str):
    from tfhybrid.serving import RedisStore
    with open(args.password_file) as f:
        return RedisStore(args.nodes, password=f.read().strip(), key_prefix=prefix,
                          timeout_s=120.0)


def worker_export_dlrm(args: argparse.Namespace) -> None:
    """2 x 2: train DLRM on ``args.dataset``, export it inline and external (3 precisions)."""
    import tensorflow as tf

    import tfhybrid
    from tfhybrid.train.data import dataset_spec, make_dataset
    from tfhybrid.train.models import build_model, export_for_serving
    mesh = tfhybrid.init(model_parallel=2)
    spec = dataset_spec(args.dataset, max_table_rows=MAX_TABLE_ROWS)
    model = build_model("dlrm", list(spec.table_rows), spec.dense_features,
                        embedding_dim=WIDTH, bottom_mlp_dims=[64, WIDTH],
                        top_mlp_dims=[64, 32, 1])
    model.compile(optimizer=tfhybrid.DistributedOptimizer(tf.keras.optimizers.Adam(0.003)),
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    model.fit(make_dataset(args.dataset, "train", global_batch_size=2048, rank=mesh.rank,
                           size=mesh.size, max_table_rows=MAX_TABLE_ROWS,
                           num_batches=args.steps), verbose=0)
    folder = os.path.join(args.out, args.dataset)
    export_for_serving(model, os.path.join(folder, "inline"))
    for precision in PRECISIONS:
        export_for_serving(model, os.path.join(folder, precision),
                           store=_store(args, f"bench-{args.dataset}-{precision}"),
                           tables="external", precision=precision)


def worker_export_big(args: argparse.Namespace) -> None:
    """2 x 2: one row-wise table of ``rows`` x 16 exported into the cluster; per-rank rates."""
    import numpy as np
    import tensorflow as tf

    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding
    from tfhybrid.serving import exporter
    mesh = tfhybrid.init(model_parallel=2)
    ids = tf.keras.Input([], dtype=tf.int32, name="ids")
    layer = DistributedEmbedding([tf.keras.layers.Embedding(
        args.rows, WIDTH, name="big",
        embeddings_initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=1))],
        row_slice_threshold=WIDTH * 1000)
    model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(layer([ids])[0]))
    model.predict(np.zeros([2], np.int32), verbose=0)
    store = _store(args, "bench-big")
    if mesh.rank == 0:
        store.check_settings()
    plan = exporter.ExportPlan(model, "external", "float32")
    written = exporter.write_external_rows(plan, store, mesh)
    with open(os.path.join(args.out, f"export_rank{mesh.rank}.json"), "w") as f:
        json.dump(dict(written, rank=mesh.rank, kind=layer.plan.tables[0].kind), f)


def worker_latency(args: argparse.Namespace) -> None:
    """One process: each arm's AUC on ``args.dataset``'s eval split and (``requests`` > 0)
    the arms served back to back on the same requests, interleaved."""
    import numpy as np
    import tensorflow as tf

    from tfhybrid.serving import Predictor
    from tfhybrid.train.data import make_dataset
    from tfhybrid.train.metrics import roc_auc
    eval_split = make_dataset(args.dataset, "eval", global_batch_size=8192,
                              max_table_rows=MAX_TABLE_ROWS, num_batches=4)
    parts = [(f, y) for f, y in eval_split]
    data = {k: np.concatenate([f[k].numpy() for f, _ in parts]) for k in parts[0][0]}
    labels = np.concatenate([y.numpy().ravel() for _, y in parts])
    folder = os.path.join(args.out, args.dataset)
    stores = {p: _store(args, f"bench-{args.dataset}-{p}") for p in PRECISIONS}
    inline = tf.saved_model.load(os.path.join(folder, "inline")).signatures[
        "serving_default"]

    def run_inline(batch: dict) -> np.ndarray:
        return inline(**{k: tf.constant(v) for k, v in batch.items()})["probability"].numpy()

    def external_arms(cache_mb: float | None) -> dict:
        """Fresh predictors (their row caches empty), one per precision; with
        ``cache_mb`` None, the default cache."""
        made = {}
        for p in PRECISIONS if cache_mb is None else ("float32",):
            options = {} if cache_mb is None else {"cache_mb": cache_mb}
            made[p] = Predictor(os.path.join(folder, p), stores[p], deadline_s=60.0, **options)
        name = "external {}" if cache_mb is None else "external {} no cache"
        return {name.format(p): predictor for p, predictor in made.items()}

    def serve(predictor):
        return lambda batch: predictor(batch)["probability"]

    result: dict = {"auc": {}, "latency": {}, "cache_hits": {}}
    scoring = {"inline": run_inline}
    scoring.update({name: serve(pr) for name, pr in external_arms(None).items()})
    scored = {name: np.concatenate([fn({k: v[i:i + 512] for k, v in data.items()})
                                    for i in range(0, len(labels), 512)])
              for name, fn in scoring.items()}
    for name, scores in scored.items():
        result["auc"][name] = roc_auc(labels, scores.ravel())
    result["samples"] = len(labels)
    result["max_diff_float32_vs_inline"] = float(np.abs(
        scored["external float32"] - scored["inline"]).max())
    rng = np.random.default_rng(0)
    for batch in BATCHES if args.requests else ():
        rounds = []
        for _ in range(ROUNDS):
            # each round starts from empty row caches: the eval split scored above
            # would otherwise have filled them with every row the requests read
            predictors = {**external_arms(None), **external_arms(0.0)}
            arms = {"inline": run_inline}
            arms.update({name: serve(pr) for name, pr in predictors.items()})
            times: dict = {name: [] for name in arms}
            requests = args.requests if batch < 512 else max(10, args.requests // 4)
            for r in range(requests + 3):
                start = rng.integers(0, len(labels) - batch + 1)
                request = {k: v[start:start + batch] for k, v in data.items()}
                for name, fn in arms.items():
                    began = time.perf_counter()
                    fn(request)
                    if r >= 3:   # the first calls trace
                        times[name].append(time.perf_counter() - began)
            rounds.append({name: {
                "p50_ms": float(np.percentile(t, 50) * 1000),
                "p99_ms": float(np.percentile(t, 99) * 1000),
                "requests_per_s": float(len(t) / np.sum(t)), "requests": len(t)}
                for name, t in times.items()})
            for name, pr in predictors.items():
                result["cache_hits"].setdefault(str(batch), {}).setdefault(name, []).append(
                    pr.stats["cache_hits"] / max(1, pr.stats["cache_hits"] +
                                                 pr.stats["rows_fetched"]))
        # each figure: the median of the rounds'; the rounds' p99 ratios kept beside
        result["latency"][str(batch)] = {name: dict(
            {key: float(np.median([r[name][key] for r in rounds]))
             for key in ("p50_ms", "p99_ms", "requests_per_s")},
            requests=rounds[0][name]["requests"],
            p99_ratio_rounds=[r[name]["p99_ms"] / r["inline"]["p99_ms"] for r in rounds])
            for name in rounds[0]}
    with open(os.path.join(folder, "latency.json"), "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------- parent
def _horovodrun(args: argparse.Namespace, worker: str, extra: list[str], timeout: float
                ) -> None:
    python = sys.executable
    command = [os.path.join(os.path.dirname(python), "horovodrun"), "-np", "4", "-H",
               "localhost:4", "--gloo", "--start-timeout", "120", python,
               os.path.abspath(__file__), "--worker", worker, *extra]
    subprocess.run(command, env=_results.child_env(), cwd=_results.ROOT, check=True,
                   timeout=timeout)


def _redis_benchmark(cluster: LocalRedisCluster, requests: int) -> dict:
    host, port = cluster.nodes[0].rsplit(":", 1)
    command = ["redis-benchmark", "--cluster", "-h", host, "-p", port, "-a", cluster.password,
               "-t", "set", "-d", str(4 * WIDTH), "-P", "64", "-n", str(requests),
               "-r", str(requests), "-q", "--csv"]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
    seconds = time.perf_counter() - began
    rows = [line.replace('"', "").split(",") for line in done.stdout.splitlines()
            if line.startswith('"SET"')]
    return {"requests_per_s": float(rows[-1][1]), "requests": requests, "seconds": seconds,
            "command": " ".join(c if c != cluster.password else "***" for c in command)}


def main() -> None:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="minutes, into a scratch folder")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows of the export-rate table (default 10M; quick 200k)")
    parser.add_argument("--steps", type=int, default=None, help="DLRM's training steps")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per arm at batch 1 and 64 (a quarter at 512)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("worker_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.out, args.nodes, args.password_file = args.worker_args[:3]
        # the worker's count: steps (export_dlrm), requests (latency), rows (export_big)
        args.rows = args.steps = args.requests = int(args.worker_args[3])
        args.dataset = args.worker_args[4] if len(args.worker_args) > 4 else "synthetic"
        {"export_dlrm": worker_export_dlrm, "export_big": worker_export_big,
         "latency": worker_latency}[args.worker](args)
        return
    rows = args.rows or (200_000 if args.quick else 10_000_000)
    steps = args.steps or (20 if args.quick else 300)
    requests = args.requests or (20 if args.quick else 1000)
    out = _results.out_dir("serving", args.quick, args.out)
    os.makedirs(out, exist_ok=True)
    print(f"serving benchmark: results into {out}", flush=True)
    load = provenance.OtherLoad()
    with tempfile.TemporaryDirectory(prefix="serving-bench-") as work, \
            LocalRedisCluster(masters=3, replicas=1, start_timeout_s=120) as cluster:
        password_file = os.path.join(work, "password")
        with open(password_file, "w") as f:
            f.write(cluster.password)
        common = [work, nodes_arg(cluster.nodes), password_file]
        measured = {}
        for dataset, count in (("synthetic", requests), ("movielens", 0)):
            _horovodrun(args, "export_dlrm", common + [str(steps), dataset], 1800)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "latency",
                            *common, str(count), dataset],
                           env=_results.child_env(OMP_NUM_THREADS=None), cwd=_results.ROOT,
                           check=True, timeout=3600)
            with open(os.path.join(work, dataset, "latency.json")) as f:
                measured[dataset] = json.load(f)
        latency = measured["synthetic"]
        _horovodrun(args, "export_big", common + [str(rows)], 3600)
        ranks = []
        for r in range(4):
            with open(os.path.join(work, f"export_rank{r}.json")) as f:
                ranks.append(json.load(f))
        # redis-benchmark's rate varies from run to run here: its median of three
        benches = [_redis_benchmark(cluster, min(rows, 2_000_000)) for _ in range(3)]
        bench = dict(sorted(benches, key=lambda b: b["requests_per_s"])[1],
                     all_requests_per_s=[b["requests_per_s"] for b in benches])
    writers = [r for r in ranks if r["rows"]]
    per_rank = [{"rank": r["rank"], "rows": r["rows"], "seconds": r["seconds"],
                 "rows_per_s": r["rows"] / r["seconds"],
                 "mb_per_s": r["bytes"] / r["seconds"] / 1e6} for r in writers]
    total_rate = sum(r["rows"] for r in writers) / max(r["seconds"] for r in writers)
    payload = {"latency": latency["latency"],
               "auc": {d: m["auc"] for d, m in measured.items()},
               "eval_samples": {d: m["samples"] for d, m in measured.items()},
               "max_diff_float32_vs_inline": {d: m["max_diff_float32_vs_inline"]
                                              for d, m in measured.items()},
               "export": {"rows": rows, "width": WIDTH, "value_bytes": 4 * WIDTH,
                          "kind": ranks[0]["kind"], "per_rank": per_rank,
                          "all_ranks_rows_per_s": total_rate},
               "redis_benchmark": bench, "dlrm_steps": steps,
               "export_vs_redis_benchmark": total_rate / bench["requests_per_s"]}
    lines = [f"# DLRM (the app's, max_table_rows {MAX_TABLE_ROWS}, width {WIDTH}, {steps} "
             "steps of 2048 on 2x2) on synthetic data; latency: one client, requests back "
             f"to back, the arms interleaved; {ROUNDS} rounds per batch size, each figure "
             "the median of the rounds'; external arms: Predictor with its default row "
             "cache (64 MB, empty at the start of each round) and, labelled, with none",
             "", "batch  arm                p50 ms   p99 ms   requests/s"]
    for batch, arms in latency["latency"].items():
        for name, figures in arms.items():
            lines.append(f"{batch:>5}  {name:<17} {figures['p50_ms']:8.2f} "
                         f"{figures['p99_ms']:8.2f} {figures['requests_per_s']:12.1f}")
    for batch in latency["latency"]:
        for arm in ("external float32", "external float32 no cache"):
            ratios = latency["latency"][batch][arm]["p99_ratio_rounds"]
            lines.append(f"p99 {arm} / inline at batch {batch}: median "
                         f"{np.median(ratios):.2f}x (rounds " +
                         ", ".join(f"{r:.2f}" for r in ratios) + ")")
    lines.append("rows read from the row cache (of the distinct rows requests looked up), "
                 "from an empty cache, median of the rounds: " + "; ".join(
                     f"batch {batch}: " + ", ".join(
                         f"{name} {np.median(shares):.1%}" for name, shares in hits.items()
                         if "no cache" not in name)
                     for batch, hits in latency["cache_hits"].items()))
    lines.append("")
    for dataset, m in measured.items():
        lines += [f"AUC on {dataset}'s eval split ({m['samples']} samples): " + ", ".join(
            f"{name} {auc:.5f}" for name, auc in m["auc"].items()),
            f"  largest |external float32 - inline| score: "
            f"{m['max_diff_float32_vs_inline']:.2e}; |AUC - float32's|: " + ", ".join(
                f"{p} {abs(m['auc'][f'external {p}'] - m['auc']['external float32']):.5f}"
                for p in PRECISIONS[1:])]
    lines += ["",
              f"# export of one {ranks[0]['kind']} table, {rows:,} rows x {WIDTH} float32 "
              f"({4 * WIDTH} B values), 2x2, writers = first replica of each position"]
    for r in per_rank:
        lines.append(f"rank {r['rank']}: {r['rows']:,} rows in {r['seconds']:.1f} s, "
                     f"{r['rows_per_s']:,.0f} rows/s, {r['mb_per_s']:.1f} MB/s")
    lines += [f"all writers: {total_rate:,.0f} rows/s",
              f"redis-benchmark -P 64 SET of {4 * WIDTH} B, {bench['requests']:,} requests, "
              "3 runs: " + ", ".join(f"{r:,.0f}" for r in bench["all_requests_per_s"])
              + f" requests/s; median {bench['requests_per_s']:,.0f}",
              f"export / redis-benchmark: {payload['export_vs_redis_benchmark']:.2f}"]
    _results.write_text(os.path.join(out, "results.txt"), lines, load)
    _results.write_json(os.path.join(out, "results.json"), payload, load)


if __name__ == "__main__":
    main()
