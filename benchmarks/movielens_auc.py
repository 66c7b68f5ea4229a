"""Held-out AUC on MovieLens-100k: DLRM (the training app) vs logistic regression.

Both models see the same features (user, item and their attributes as categorical ids;
age and the 19 genre flags as dense) and the same train/eval split of
``tfhybrid.train.data`` (a rating >= 4 is a click). The baseline is logistic regression:
one weight per categorical id plus a linear term on the dense features, trained with
the same optimizer, batch size and epochs, in the same run.

Usage: .venv/bin/python benchmarks/movielens_auc.py [--epochs 5] [--batch_size 256]
"""

from __future__ import annotations

import argparse
import os
import time


def logistic_regression_auc(args) -> float:
    import numpy as np
    import tensorflow as tf

    from tfhybrid.train import data as data_lib
    from tfhybrid.train import metrics

    spec = data_lib.dataset_spec("movielens")
    dense = tf.keras.Input([spec.dense_features], name="dense")
    categorical = tf.keras.Input([len(spec.table_rows)], dtype=tf.int32, name="categorical")
    # one scalar weight per id of every table: a linear model over one-hot features
    weights = [tf.keras.layers.Embedding(rows, 1, embeddings_initializer="zeros")(
        categorical[:, t]) for t, rows in enumerate(spec.table_rows)]
    logit = tf.keras.layers.Add()(weights + [tf.keras.layers.Dense(1, name="dense_weights")(dense)])
    model = tf.keras.Model({"dense": dense, "categorical": categorical}, logit)
    model.compile(optimizer=tf.keras.optimizers.Adagrad(args.learning_rate),
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
    options = dict(global_batch_size=args.batch_size, seed=args.seed)
    model.fit(data_lib.make_dataset("movielens", "train", **options), epochs=args.epochs,
              verbose=0)
    labels, scores = [], []
    for features, y in data_lib.make_dataset("movielens", "eval", **options):
        scores.append(model(features).numpy().reshape(-1))
        labels.append(y.numpy().reshape(-1))
    return metrics.roc_auc(np.concatenate(labels), np.concatenate(scores))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfhybrid.train import app

    start = time.perf_counter()
    dlrm = app.run(app.TrainConfig(
        model="dlrm", dataset="movielens", optimizer="adagrad",
        learning_rate=args.learning_rate, batch_size=args.batch_size, epochs=args.epochs,
        embedding_dim=16, bottom_mlp_dims=(64, 16), top_mlp_dims=(64, 32, 1),
        seed=args.seed, warmup_steps=0))
    dlrm_seconds = time.perf_counter() - start
    start = time.perf_counter()
    baseline = logistic_regression_auc(args)
    lr_seconds = time.perf_counter() - start
    print(f"\nMovieLens-100k held-out AUC ({dlrm['eval_samples']:,} eval samples, "
          f"{args.epochs} epochs, batch {args.batch_size}, Adagrad lr {args.learning_rate}):")
    print(f"  logistic regression (baseline) {baseline:.4f}   ({lr_seconds:.0f} s)")
    print(f"  DLRM                           {dlrm['auc']:.4f}   ({dlrm_seconds:.0f} s)")
    print(f"  DLRM - baseline                {dlrm['auc'] - baseline:+.4f}")


if __name__ == "__main__":
    main()
