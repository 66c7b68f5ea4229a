"""The 2 x 2 job of tests/test_serving.py: train, export, publish deltas (4 ranks).

``python -m tests._serving_job OUT NODES PASSWORD_FILE`` under horovodrun -np 4. Trains
a user model (a DistributedEmbedding holding a row-wise, a column-sliced, a table-wise
and a replicated table, beside a Keras Embedding), the app's DLRM and DCN-v2 for a few
steps on 2 x 2, exports them with external tables (float32; the DLRM also float16 and
int8) and writes, on rank 0, ``OUT/expected.npz`` (each model's ``predict`` on fixed
inputs) and ``OUT/job.json`` (plans, export paths, publish history). Then trains the
user model on with ``PublishDeltas(every_steps=10)`` while rank 0's ``Predictor`` reads
after every publish, and records the largest difference to the model's own scores.
Then a model of two dynamic tables (int64 keys, negative ones included, with a default
row; string keys) beside a fixed one: exported external and inline (``OUT/dynamic``,
``OUT/dynamic_inline``, its probe in ``OUT/dynamic_probe.npz``), then trained on keys
that drift past a small capacity with ``PublishDeltas(every_steps=5)``: evicted keys are
deleted from the store and read the default row, as in the model. Last, a model with
weighted ragged and dense bags whose layer syncs replicas by weights
(``ragged_part``).
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tfhybrid
from tfhybrid.layers import DistributedEmbedding, DynamicEmbedding, Embedding
from tfhybrid.serving import Predictor, PublishDeltas, RedisStore, export
from tfhybrid.train.data import dataset_spec, make_dataset
from tfhybrid.train.models import build_model, export_for_serving

# sizes: elements (rows x width) against the thresholds below decide each table's kind
TABLES = [("rowwise", 3000, 8, "sum"), ("sliced", 600, 16, "mean"), ("tablewise", 300, 8, None),
          ("replicated", 20, 8, None)]
THRESHOLDS = dict(row_slice_threshold=20_000, column_slice_threshold=9_000,
                  data_parallel_threshold=200)
HOTNESS = 3
BATCH = 32
STEPS = 12
DELTA_STEPS = 30
EVERY = 10


def user_model() -> tf.keras.Model:
    inputs = {"rowwise": tf.keras.Input([HOTNESS], dtype=tf.int32, name="rowwise"),
              "sliced": tf.keras.Input([HOTNESS], dtype=tf.int32, name="sliced"),
              "tablewise": tf.keras.Input([], dtype=tf.int32, name="tablewise"),
              "replicated": tf.keras.Input([], dtype=tf.int32, name="replicated"),
              "local": tf.keras.Input([], dtype=tf.int32, name="local"),
              "dense": tf.keras.Input([3], dtype=tf.float32, name="dense")}
    init = lambda t: tf.keras.initializers.RandomUniform(-0.1, 0.1, seed=t)  # noqa: E731
    layer = DistributedEmbedding(
        [Embedding(rows, dim, combiner=combiner, name=name, embeddings_initializer=init(t))
         if combiner else tf.keras.layers.Embedding(rows, dim, name=name,
                                                     embeddings_initializer=init(t))
         for t, (name, rows, dim, combiner) in enumerate(TABLES)], **THRESHOLDS,
        name="user_tables")
    vectors = layer([inputs[name] for name, *_ in TABLES])
    local = tf.keras.layers.Embedding(10, 4, name="local_table",
                                      embeddings_initializer=init(9))(inputs["local"])
    joined = tf.keras.layers.Concatenate(name="joined")(vectors + [local, inputs["dense"]])
    hidden = tf.keras.layers.Dense(8, activation="relu", name="hidden",
                                   kernel_initializer=tf.keras.initializers.GlorotUniform(1))(
        joined)
    out = tf.keras.layers.Dense(1, name="score",
                                kernel_initializer=tf.keras.initializers.GlorotUniform(2))(hidden)
    return tf.keras.Model(inputs, out)


def user_batch(rng: np.random.Generator, n: int) -> tuple[dict, np.ndarray]:
    x = {"rowwise": rng.integers(0, 3000, [n, HOTNESS]),
         "sliced": rng.integers(0, 600, [n, HOTNESS]),
         "tablewise": rng.integers(0, 300, [n]), "replicated": rng.integers(0, 20, [n]),
         "local": rng.integers(0, 10, [n])}
    x = {k: v.astype(np.int32) for k, v in x.items()}
    x["dense"] = rng.normal(size=[n, 3]).astype(np.float32)
    y = ((x["rowwise"][:, 0] % 2) ^ (x["tablewise"] % 2)).astype(np.float32)[:, None]
    return x, y


# the dynamic model: keys trained (negative ones included), keys never seen
TRAINED_KEYS = np.array([-(1 << 62), -(1 << 40), -17, -1, 0, 3, 12, 99, 1 << 33, 1 << 50,
                         (1 << 63) - 1, 64])
FRESH_KEYS = np.array([-(1 << 61), -2, 5, 1 << 40, 10 ** 15])
NAMES = 10
DYNAMIC_STEPS = 8
DYNAMIC_EVERY = 5


def dynamic_model(capacity: int) -> tf.keras.Model:
    inputs = {"keys": tf.keras.Input([2], dtype=tf.int64, name="keys"),
              "name": tf.keras.Input([], dtype=tf.string, name="name"),
              "item": tf.keras.Input([], dtype=tf.int32, name="item")}
    layer = DistributedEmbedding([
        DynamicEmbedding(4, capacity=capacity, combiner="mean", default_row=0.25,
                         name="keyed", seed=3,
                         initializer=tf.keras.initializers.RandomUniform(-0.1, 0.1)),
        DynamicEmbedding(4, capacity=64, key_dtype=tf.string, name="named", seed=4),
        Embedding(30, 4, name="items",
                  embeddings_initializer=tf.keras.initializers.RandomUniform(-0.1, 0.1, 5))],
        name="dynamic_tables")
    vectors = layer([inputs["keys"], inputs["name"], inputs["item"]])
    out = tf.keras.layers.Dense(1, name="score", kernel_initializer=tf.keras.initializers
                                .GlorotUniform(3))(tf.keras.layers.Concatenate()(vectors))
    model = tf.keras.Model(inputs, out)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)),
                  loss="mse")
    return model


def dynamic_batch(rng: np.random.Generator, n: int, keys: np.ndarray, names: list
                  ) -> dict:
    return {"keys": keys[rng.integers(0, len(keys), [n, 2])].astype(np.int64),
            "name": np.array([names[i] for i in rng.integers(0, len(names), [n])], object),
            "item": rng.integers(0, 30, [n]).astype(np.int32)}


def dynamic_part(out: str, mesh, store: RedisStore, delta_store: RedisStore,
                 report: dict, expected: dict) -> None:
    """The dynamic model: exports, a probe of trained and fresh keys, drifting deltas."""
    names = [f"user:{i}" for i in range(NAMES)]
    model = dynamic_model(capacity=64)
    model.fit(dynamic_batch(np.random.default_rng(200 + mesh.rank), BATCH * DYNAMIC_STEPS,
                            TRAINED_KEYS, names),
              np.ones([BATCH * DYNAMIC_STEPS, 1]), batch_size=BATCH, verbose=0)
    rng = np.random.default_rng(7)
    probe = dynamic_batch(rng, 16, np.concatenate([TRAINED_KEYS, FRESH_KEYS]),
                          names + ["new:a", "new:b"])
    expected["dynamic"] = model.predict(probe, verbose=0)
    # every trained key was admitted (capacity holds them all): the fresh ones are the
    # keys that read the default row, each counted once per call
    trained = set()
    for r in range(mesh.size):
        seen = dynamic_batch(np.random.default_rng(200 + r), BATCH * DYNAMIC_STEPS,
                             TRAINED_KEYS, names)
        trained |= set(seen["keys"].ravel().tolist()) | set(seen["name"].tolist())
    report["dynamic_default_rows"] = len(set(probe["keys"].ravel().tolist()) - trained) + \
        len(set(probe["name"].tolist()) - trained)
    report["dynamic_exports"] = {
        "external": export(model, os.path.join(out, "dynamic"), store, tables="external"),
        "inline": export(model, os.path.join(out, "dynamic_inline"))}
    if mesh.rank == 0:
        np.savez(os.path.join(out, "dynamic_probe.npz"),
                 **dict(probe, name=probe["name"].astype(bytes)))
    # keys drift past a capacity of 8: each publish deletes the keys evicted since the
    # last, which then read the default row in the model and in the served copy
    # built after the exports: every rank made the served copies, so it trains in step
    drifting = dynamic_model(capacity=8)
    publish = PublishDeltas(os.path.join(out, "dynamic_deltas"), delta_store,
                            every_steps=DYNAMIC_EVERY)
    history = []
    for part in range(3):
        keys = TRAINED_KEYS[4 * part:4 * part + 4]
        x = dynamic_batch(np.random.default_rng(300 + 10 * part + mesh.rank),
                          BATCH * DYNAMIC_EVERY, keys, names)
        drifting.fit(x, np.ones([BATCH * DYNAMIC_EVERY, 1]), batch_size=BATCH, verbose=0,
                     shuffle=False, callbacks=[publish])
        own = drifting.predict(probe, verbose=0)
        if mesh.rank == 0:
            served = Predictor(os.path.join(out, "dynamic_deltas"), delta_store)(probe)
            history.append(dict(publish.history[-1],
                                max_diff=float(np.abs(served["output"] - own).max())))
    report["dynamic_deltas"] = history


RAGGED_ROWS = 500


def ragged_model() -> tf.keras.Model:
    """Weighted ragged ids (bags of any length, empty ones too), one id per example, and
    weighted bags of three, in a layer whose replicas keep their own weights between
    syncs."""
    inputs = {"words": tf.keras.Input([None], dtype=tf.int32, ragged=True, name="words"),
              "word_weights": tf.keras.Input([None], dtype=tf.float32, ragged=True,
                                             name="word_weights"),
              "item": tf.keras.Input([], dtype=tf.int32, name="item"),
              "tags": tf.keras.Input([3], dtype=tf.int32, name="tags"),
              "tag_weights": tf.keras.Input([3], dtype=tf.float32, name="tag_weights")}
    init = lambda t: tf.keras.initializers.RandomUniform(-0.1, 0.1, seed=t)  # noqa: E731
    layer = DistributedEmbedding(
        [Embedding(RAGGED_ROWS, 8, combiner="mean", name="words", embeddings_initializer=init(1)),
         Embedding(40, 8, name="items", embeddings_initializer=init(2)),
         Embedding(60, 8, combiner="sqrtn", name="tags", embeddings_initializer=init(3))],
        row_slice_threshold=2000, replica_sync="weights", sync_every=1000,
        name="ragged_tables")
    vectors = layer([(inputs["words"], inputs["word_weights"]), inputs["item"],
                     (inputs["tags"], inputs["tag_weights"])])
    out = tf.keras.layers.Dense(1, name="score", kernel_initializer=tf.keras.initializers
                                .GlorotUniform(4))(tf.keras.layers.Concatenate()(vectors))
    return tf.keras.Model(inputs, out)


def ragged_batch(rng: np.random.Generator, n: int) -> dict:
    lengths = rng.integers(0, 5, [n])
    count = int(lengths.sum())
    # weights of 0 and below drop their id from a mean bag (a bag may lose them all)
    return {"words": tf.RaggedTensor.from_row_lengths(
                rng.integers(0, RAGGED_ROWS, [count]).astype(np.int32), lengths),
            "word_weights": tf.RaggedTensor.from_row_lengths(
                rng.choice([-1.0, 0.0, 0.5, 1.0, 2.5], [count]).astype(np.float32), lengths),
            "item": rng.integers(0, 40, [n]).astype(np.int32),
            "tags": rng.integers(0, 60, [n, 3]).astype(np.int32),
            "tag_weights": rng.uniform(0.1, 2.0, [n, 3]).astype(np.float32)}


def ragged_part(out: str, mesh, store: RedisStore, report: dict, expected: dict) -> None:
    """Ragged inputs, replicas synced by weights: each replica trains on its own data, so
    the replicas differ until the export syncs them; each rank's scores before the
    export go to ``OUT/ragged_before_{rank}.npy``, the synced model's to expected."""
    model = ragged_model()
    compile_(model, 0.5)
    x = ragged_batch(np.random.default_rng(400 + mesh.rank), BATCH * 6)
    y = (x["item"] % 2).astype(np.float32)[:, None]
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), verbose=0)
    probe = ragged_batch(np.random.default_rng(8), 24)
    probe_data = tf.data.Dataset.from_tensor_slices(probe).batch(24)
    np.save(os.path.join(out, f"ragged_before_{mesh.rank}.npy"),
            model.predict(probe_data, verbose=0))
    report["exports"]["ragged"] = export(model, os.path.join(out, "ragged"), store,
                                         tables="external")
    expected["ragged"] = model.predict(probe_data, verbose=0)
    if mesh.rank == 0:
        np.savez(os.path.join(out, "ragged_probe.npz"), **{
            k: v for k, v in probe.items() if not isinstance(v, tf.RaggedTensor)}, **{
            f"{k}.{part}": getattr(v, part).numpy() for k, v in probe.items()
            if isinstance(v, tf.RaggedTensor) for part in ("values", "row_splits")})


def compile_(model: tf.keras.Model, rate: float) -> None:
    model.compile(optimizer=tfhybrid.DistributedOptimizer(tf.keras.optimizers.SGD(rate)),
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))


def main(out: str, nodes: str, password_file: str) -> None:
    mesh = tfhybrid.init(model_parallel=2)
    with open(password_file) as f:
        password = f.read().strip()
    # one key prefix per export, and one for the deltas (rows updated in place must not
    # be the rows of the user model's export)
    store = {name: RedisStore(nodes, password=password, key_prefix=f"job-{name}")
             for name in ("user", "user_int8", "dlrm_float32", "dlrm_float16", "dlrm_int8",
                          "dcnv2_float32", "deltas", "dynamic", "dynamic_deltas", "ragged")}
    report: dict = {"exports": {}}
    expected = {}
    fixed = np.random.default_rng(99)

    # the user model: every sharding kind, a Keras Embedding beside them
    model = user_model()
    compile_(model, 0.5)
    x, y = user_batch(np.random.default_rng(mesh.rank), BATCH * STEPS)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    layer = [m for m in model.layers if isinstance(m, DistributedEmbedding)][0]
    report["user_kinds"] = {p.name: p.kind for p in layer.plan.tables}
    probe, _ = user_batch(fixed, 64)
    expected["user"] = model.predict(probe, verbose=0)
    if mesh.rank == 0:
        np.savez(os.path.join(out, "user_probe.npz"), **probe)
    report["exports"]["user"] = export(model, os.path.join(out, "user"), store["user"],
                                       tables="external")
    # int8 rows: the column-sliced table's slices each with their own scale
    report["exports"]["user_int8"] = export(model, os.path.join(out, "user_int8"),
                                            store["user_int8"], tables="external",
                                            precision="int8")
    # the app's models, on the app's synthetic data
    eval_data = make_dataset("synthetic", "eval", global_batch_size=4096, rank=0, size=1,
                             max_table_rows=2000, num_batches=1)
    (eval_x, eval_y), = [(
        {k: v.numpy() for k, v in features.items()}, labels.numpy())
        for features, labels in eval_data.take(1)]
    if mesh.rank == 0:
        np.savez(os.path.join(out, "app_eval.npz"), labels=eval_y, **eval_x)
    for kind in ("dlrm", "dcnv2"):
        train = make_dataset("synthetic", "train", global_batch_size=4 * 64, rank=mesh.rank,
                             size=mesh.size, max_table_rows=2000, num_batches=40)
        extra = (dict(bottom_mlp_dims=[16, 8]) if kind == "dlrm"
                 else dict(num_cross_layers=2))
        app = build_model(kind, _rows(), 13, embedding_dim=8,
                          top_mlp_dims=[16, 1], **extra)
        compile_(app, 0.1)
        app.fit(train, epochs=1, verbose=0)
        expected[kind] = tf.sigmoid(app.predict(eval_x, batch_size=512, verbose=0)).numpy()
        precisions = ("float32", "float16", "int8") if kind == "dlrm" else ("float32",)
        for precision in precisions:
            name = f"{kind}_{precision}"
            report["exports"][name] = export_for_serving(
                app, os.path.join(out, name), store=store[name], tables="external",
                precision=precision)

    # fresh models: publish every EVERY steps; after each publish rank 0 serves. fit runs
    # EVERY steps at a time, so the model's own scores come from predict between fits
    # (no collective of a callback's call runs inside fit's steps)
    history = []
    publish = PublishDeltas(os.path.join(out, "deltas"), store["deltas"], every_steps=EVERY,
                            keep_versions=2)
    more_x, more_y = user_batch(np.random.default_rng(100 + mesh.rank), BATCH * DELTA_STEPS)
    # one predictor through every publish: its row cache must start again at each version
    served_deltas = None
    for part in range(DELTA_STEPS // EVERY):
        rows = slice(part * EVERY * BATCH, (part + 1) * EVERY * BATCH)
        model.fit({k: v[rows] for k, v in more_x.items()}, more_y[rows], batch_size=BATCH,
                  epochs=1, verbose=0, shuffle=False, callbacks=[publish])
        own = model.predict(probe, verbose=0)
        if mesh.rank == 0:
            served_deltas = served_deltas or Predictor(os.path.join(out, "deltas"),
                                                       store["deltas"])
            served = served_deltas(probe)
            history.append(dict(publish.history[-1],
                                max_diff=float(np.abs(served["output"] - own).max())))
    dynamic_part(out, mesh, store["dynamic"], store["dynamic_deltas"], report, expected)
    ragged_part(out, mesh, store["ragged"], report, expected)
    if mesh.rank == 0:
        report["deltas"] = history
        report["delta_versions"] = sorted(os.listdir(os.path.join(out, "deltas")))
        report["table_rows"] = {name: rows for name, rows, *_ in TABLES}
        np.savez(os.path.join(out, "expected.npz"), **expected)
        with open(os.path.join(out, "job.json"), "w") as f:
            json.dump(report, f)


def _rows() -> list[int]:
    return list(dataset_spec("synthetic", max_table_rows=2000).table_rows)


if __name__ == "__main__":
    main(*sys.argv[1:4])
