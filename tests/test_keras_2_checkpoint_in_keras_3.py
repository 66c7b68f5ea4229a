"""A Keras 2 checkpoint of a model, read into the same model built in Keras 3.

One Keras 2 process fits a DLRM-like model (a ``DistributedEmbedding``, dense layers)
for two steps and saves it twice: ``model.save_weights`` (TF format) and a
``tf.train.Checkpoint`` holding model and optimizer. A Keras 3 process builds the same
model and reads both with ``load_keras_2_checkpoint``: every table and dense weight must
equal the saved one exactly (also with the top layers in a nested ``Sequential``), and
the optimizer's keys come back as left unread. A model whose weights have no Keras 2
place (a layer with a layer inside it, DCN-v2's ``Cross``; an extra layer) must raise
``ValueError`` naming them. Each side runs as its own process, since a process
holds one Keras.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import tensorflow as tf

from tests.runner import TEST_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = [("user", 40, 4), ("item", 30, 4)]
TIMEOUT_S = 240


# ------------------------------------------------------- the child processes' side
def _model(top: str = "plain", extra: bool = False):
    import tfhybrid
    from tfhybrid.layers import DistributedEmbedding, Embedding
    from tfhybrid.optimizers import RowWiseAdagrad

    mesh = tfhybrid.init(model_parallel=1)
    ids = [tf.keras.Input([2], dtype=tf.int64, name=f"{name}_ids") for name, *_ in TABLES]
    layer = DistributedEmbedding([Embedding(rows, dim, combiner="sum", name=name)
                                  for name, rows, dim in TABLES], mesh=mesh)
    joined = tf.keras.layers.Concatenate(axis=1)(layer(ids))
    if top == "nested":
        out = tf.keras.Sequential([tf.keras.layers.Dense(4), tf.keras.layers.Dense(1)])(joined)
    elif top == "cross":
        from tfhybrid.train.models import Cross
        out = tf.keras.layers.Dense(1)(Cross(projection_dim=None, seed=3)(joined, joined))
    else:
        hidden = tf.keras.layers.Dense(4, activation="relu")(joined)
        if extra:
            hidden = tf.keras.layers.Dense(4)(hidden)
        out = tf.keras.layers.Dense(1)(hidden)
    model = tf.keras.Model(ids, out)
    model.compile(optimizer=tfhybrid.DistributedOptimizer(
        tf.keras.optimizers.Adam(0.01), embedding_optimizer=RowWiseAdagrad(0.1)), loss="mse")
    return model, layer


def _weights(model, layer) -> list:
    return layer.get_weights() + [w for dense in model.layers
                                  if dense is not layer for w in dense.get_weights()]


def _child(mode: str, directory: str) -> None:
    from tfhybrid.checkpoint.keras_2 import load_keras_2_checkpoint

    if mode == "save":
        for top in ("plain", "nested", "cross"):
            model, layer = _model(top)
            rng = np.random.default_rng(0)
            ids = [rng.integers(0, rows, [8, 2]) for _, rows, _ in TABLES]
            model.fit(ids, rng.normal(size=[8, 1]).astype(np.float32), batch_size=4, verbose=0)
            model.save_weights(os.path.join(directory, f"{top}-weights"))
            tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
                os.path.join(directory, f"{top}-ckpt"))
            np.savez(os.path.join(directory, f"{top}.npz"), *_weights(model, layer))
        return
    results = {}
    for source in ("plain-weights", "plain-ckpt", "nested-ckpt"):
        top = source.split("-")[0]
        saved = np.load(os.path.join(directory, f"{top}.npz"))
        saved = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        model, layer = _model(top)
        left = load_keras_2_checkpoint(model, os.path.join(directory, source))
        got = _weights(model, layer)
        results[source] = {"equal": len(got) == len(saved) and all(
            np.array_equal(a, b) for a, b in zip(got, saved)), "left": left}
    for source, kwargs in (("cross-ckpt", {"top": "cross"}), ("plain-ckpt", {"extra": True})):
        model, _ = _model(**kwargs)
        try:
            load_keras_2_checkpoint(model, os.path.join(directory, source))
            results[f"{source}-{sorted(kwargs)[0]}"] = "no error"
        except ValueError as e:
            results[f"{source}-{sorted(kwargs)[0]}"] = str(e)
    with open(os.path.join(directory, "results.json"), "w") as f:
        json.dump(results, f)


# ------------------------------------------------------- the test's side
def _run(mode: str, directory: str, legacy_keras: str) -> None:
    env = {**os.environ, **TEST_ENV, "TF_USE_LEGACY_KERAS": legacy_keras}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "tests.test_keras_2_checkpoint_in_keras_3",
                           mode, directory], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise AssertionError(f"the {mode} process failed:\n{done.stderr[-4000:]}")


class Keras2CheckpointInKeras3Test(tf.test.TestCase):

    def test_weights_read_exactly_and_misfits_are_named(self):
        directory = tempfile.mkdtemp(prefix="tfhybrid-k2-in-k3-")
        self.addCleanup(shutil.rmtree, directory, True)
        _run("save", directory, "1")
        _run("load", directory, "0")
        with open(os.path.join(directory, "results.json")) as f:
            results = json.load(f)
        for source in ("plain-weights", "plain-ckpt", "nested-ckpt"):
            self.assertTrue(results[source]["equal"], source)
        # save_weights holds the optimizer too; the checkpoint holds it under its name
        for source in ("plain-weights", "plain-ckpt", "nested-ckpt"):
            left = results[source]["left"]
            self.assertTrue(left, source)
            self.assertTrue(all(key.startswith("optimizer/") or key == "save_counter"
                                or "/optimizer/" in key for key in left), left)
        self.assertRegex(results["cross-ckpt-top"], r"model/layer_with_weights-1/.*have no "
                         r"place.*layers with layers inside them.*\['cross")
        self.assertRegex(results["plain-ckpt-extra"], r"does not fit this Keras 3 model")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] in ("save", "load"):
        _child(sys.argv[1], sys.argv[2])
    else:
        tf.test.main()
