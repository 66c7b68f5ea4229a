"""Which Keras tfhybrid runs with: the one TensorFlow gives, which is the user's choice.
Importing tfhybrid leaves TF_USE_LEGACY_KERAS alone, so tf.keras is what it would be
without tfhybrid: Keras 3 from TF 2.16 where the variable is unset or 0, Keras 2
(tf-keras) where it is 1 (and on TF <= 2.15). Each case runs in a fresh interpreter, as a
user's script would."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import unittest

from tfhybrid import installed_keras_major

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    clean.update(env, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-c", code], env=clean, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


# the version of the package that defines tf.keras.Model (tf.keras of TF <= 2.15 has no
# __version__ of its own)
_PRINT_KERAS = ("import sys; import tensorflow as tf; "
                "print('KERAS', sys.modules[tf.keras.Model.__module__.split('.')[0]]"
                ".__version__)")


class KerasVersionTest(unittest.TestCase):

    def test_importing_tfhybrid_leaves_the_choice_to_tensorflow(self):
        without = _run("import tensorflow as tf\n" + _PRINT_KERAS)
        self.assertEqual(without.returncode, 0, without.stderr[-3000:])
        chosen_by_tf = re.search(r"KERAS (\S+)", without.stdout).group(1)
        out = _run("import os\nimport tensorflow as tf\nimport tfhybrid.layers\n"
                   "print('ENV', os.environ.get('TF_USE_LEGACY_KERAS'))\n"
                   "print('MAJOR', tfhybrid.keras_major())\n" + _PRINT_KERAS)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertIn("ENV None", out.stdout)
        self.assertIn(f"KERAS {chosen_by_tf}", out.stdout)
        self.assertIn(f"MAJOR {chosen_by_tf.split('.')[0]}", out.stdout)
        # the Keras the installed TensorFlow makes its default
        self.assertEqual(int(chosen_by_tf.split(".")[0]), installed_keras_major() or 2)

    def test_keras_3_as_tf_keras_is_used_as_it_is(self):
        if installed_keras_major() != 3:
            self.skipTest("no Keras 3 installed (TF <= 2.15): tf.keras is always Keras 2")
        fit = ("\nimport numpy as np\nimport tfhybrid\n"
               "from tfhybrid.layers import DistributedEmbedding, Embedding\n"
               "tfhybrid.init(model_parallel=1)\n"
               "ids = tf.keras.Input([2], dtype=tf.int64)\n"
               "emb = DistributedEmbedding([Embedding(50, 4, combiner='sum')])\n"
               "model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(emb([ids])[0]))\n"
               "model.compile(optimizer=tfhybrid.DistributedOptimizer("
               "tf.keras.optimizers.SGD(0.1), embedding_optimizer="
               "tfhybrid.optimizers.RowWiseAdagrad(0.1)), loss='mse')\n"
               "history = model.fit(np.ones([8, 2], np.int64), np.ones([8, 1]), verbose=0)\n"
               "print('LOSS', history.history['loss'][0])\n")
        for code, env, trains in (
                # nothing chose: TensorFlow's default, and a model trains
                ("import tensorflow as tf\nimport tfhybrid.optimizers", {}, True),
                # the user touched tf.keras (Keras 3) before importing tfhybrid
                ("import tensorflow as tf\ntf.keras.layers.Dense\nimport tfhybrid.layers",
                 {}, False),
                # horovod's TensorFlow module touches tf.keras as it loads
                ("import horovod.tensorflow as hvd\nimport tensorflow as tf\n"
                 "import tfhybrid.layers", {}, False),
                # the user asked for Keras 3 explicitly: and a model trains
                ("import tensorflow as tf\nimport tfhybrid.optimizers",
                 {"TF_USE_LEGACY_KERAS": "0"}, True)):
            out = _run(code + (fit if trains else "\n") + _PRINT_KERAS, **env)
            self.assertEqual(out.returncode, 0, code + out.stderr[-3000:])
            self.assertRegex(out.stdout, r"KERAS 3\.", code)
            if trains:
                self.assertRegex(out.stdout, r"LOSS \d", code)

    def test_another_keras_is_refused_naming_it(self):
        # the version tf.keras reports (TF >= 2.16) and its package's (TF 2.15), faked
        out = _run("import sys\nimport tensorflow as tf\n"
                   "sys.modules[tf.keras.Model.__module__.split('.')[0]].__version__ = "
                   "'4.0.0'\ntf.keras.__version__ = '4.0.0'\nimport tfhybrid.layers",
                   TF_USE_LEGACY_KERAS="0")
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("tfhybrid runs with Keras 2 (tf-keras) or Keras 3 as tf.keras, but "
                      "tf.keras is Keras '4.0.0'", out.stderr)

    def test_legacy_keras_from_the_environment_survives_horovod_first(self):
        out = _run("import horovod.tensorflow as hvd\nimport tfhybrid.layers\n" + _PRINT_KERAS,
                   TF_USE_LEGACY_KERAS="1")
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertRegex(out.stdout, r"KERAS 2\.")

    def test_an_explicit_legacy_setting_is_kept(self):
        out = _run("import os\nimport tfhybrid\nprint('ENV', os.environ['TF_USE_LEGACY_KERAS'])",
                   TF_USE_LEGACY_KERAS="true")
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertIn("ENV true", out.stdout)


if __name__ == "__main__":
    unittest.main()
