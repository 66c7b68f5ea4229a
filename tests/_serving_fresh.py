"""The fresh serving process of tests/test_serving.py: Predictor scores of every export.

``python -m tests._serving_fresh OUT NODES PASSWORD_FILE`` (one plain process): serves
each export of the job in ``OUT`` with ``tfhybrid.serving.Predictor`` (the dynamic
model's inline export through plain ``tf.saved_model.load``), writes the scores to
``OUT/served.npz`` and prints, as JSON, the keys that read a dynamic table's default row
and which of Horovod, tfhybrid's op library and its layers the process imported (none
may be).
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

from tfhybrid.serving import Predictor, RedisStore


def main(out: str, nodes: str, password_file: str) -> None:
    with open(password_file) as f:
        password = f.read().strip()
    with open(os.path.join(out, "job.json")) as f:
        job = json.load(f)
    user_probe = dict(np.load(os.path.join(out, "user_probe.npz")))
    app_eval = dict(np.load(os.path.join(out, "app_eval.npz")))
    app_eval.pop("labels")
    served = {}
    for name, path in job["exports"].items():
        store = RedisStore(nodes, password=password, key_prefix=f"job-{name}")
        predictor = Predictor(path, store)
        if name == "user":
            served[name] = predictor(user_probe)["output"]
            keys, hits = predictor.stats["keys_fetched"], predictor.stats["cache_hits"]
            again = predictor(user_probe)["output"]
            uncached = Predictor(path, store, cache_mb=0)(user_probe)["output"]
            cache = {"second_call_keys": predictor.stats["keys_fetched"] - keys,
                     "second_call_hits": predictor.stats["cache_hits"] - hits,
                     "same_as_uncached": bool(np.array_equal(again, uncached) and
                                              np.array_equal(again, served[name]))}
        elif name.startswith("user"):
            served[name] = predictor(user_probe)["output"]
        elif name == "ragged":
            saved = dict(np.load(os.path.join(out, "ragged_probe.npz")))
            probe = {k: v for k, v in saved.items() if "." not in k}
            for k in ("words", "word_weights"):
                probe[k] = tf.RaggedTensor.from_row_splits(saved[f"{k}.values"],
                                                           saved[f"{k}.row_splits"])
            served[name] = predictor(probe)["output"]
            # the same request with its bags as lists
            served["ragged_lists"] = predictor(dict(probe, **{
                k: probe[k].to_list() for k in ("words", "word_weights")}))["output"]
            # and with the ids from the SavedModel's feature_ids, as for a model that
            # computes its ids
            predictor.layout.id_groups = None
            served["ragged_feature_ids"] = predictor(probe)["output"]
        else:
            served[name] = predictor(app_eval)["probability"]
        store.close()
    dynamic_probe = dict(np.load(os.path.join(out, "dynamic_probe.npz")))
    store = RedisStore(nodes, password=password, key_prefix="job-dynamic")
    predictor = Predictor(job["dynamic_exports"]["external"], store)
    served["dynamic"] = predictor(dynamic_probe)["output"]
    default_rows = predictor.stats["default_rows"]
    store.close()
    inline = tf.saved_model.load(job["dynamic_exports"]["inline"]).signatures[
        "serving_default"]
    served["dynamic_inline"] = inline(**{k: tf.constant(v) for k, v in
                                         dynamic_probe.items()})["output"].numpy()
    np.savez(os.path.join(out, "served.npz"), **served)
    print(json.dumps({"default_rows": default_rows, "cache": cache, "imported": sorted(m for m in sys.modules if m == "horovod" or
                                         m.startswith(("horovod.", "tfhybrid.custom_ops",
                                                       "tfhybrid.layers")))}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
