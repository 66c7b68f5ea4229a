"""The fresh serving process of tests/test_serving.py: Predictor scores of every export.

``python -m tests._serving_fresh OUT NODES PASSWORD_FILE`` (one plain process): serves
each export of the job in ``OUT`` with ``tfhybrid.serving.Predictor``, writes the scores
to ``OUT/served.npz`` and prints, as JSON, which of Horovod, tfhybrid's op library and
its layers the process imported (none may be).
"""

import json
import os
import sys

import numpy as np

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
        if name.startswith("user"):
            served[name] = predictor(user_probe)["output"]
        else:
            served[name] = predictor(app_eval)["probability"]
        store.close()
    np.savez(os.path.join(out, "served.npz"), **served)
    print(json.dumps({"imported": sorted(m for m in sys.modules if m == "horovod" or
                                         m.startswith(("horovod.", "tfhybrid.custom_ops",
                                                       "tfhybrid.layers")))}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
