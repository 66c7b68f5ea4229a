"""tfhybrid runs on Keras 2 (tf-keras): its import selects it where Keras 3 is installed
(TF >= 2.16 makes Keras 3 tf.keras by default), and a Keras 3 tf.keras fails at import
with an error that says what to do. Each case runs in a fresh interpreter without
TF_USE_LEGACY_KERAS, as a user's script would."""

from __future__ import annotations

import os
import subprocess
import sys
import unittest
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _keras_3_installed() -> bool:
    try:
        return metadata.version("keras").startswith("3.")
    except metadata.PackageNotFoundError:
        return False


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

    def test_importing_tfhybrid_first_gives_keras_2(self):
        out = _run("import tensorflow as tf\nimport tfhybrid.layers\n" + _PRINT_KERAS)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertRegex(out.stdout, r"KERAS 2\.")

    def test_keras_3_as_tf_keras_fails_at_import_naming_the_fix(self):
        if not _keras_3_installed():
            self.skipTest("no Keras 3 installed (TF <= 2.15): tf.keras is always Keras 2")
        used_first = "tf.keras was used before tfhybrid was imported"
        for code, env, cause in (
                # the user touched tf.keras (Keras 3) before importing tfhybrid
                ("import tensorflow as tf\ntf.keras.layers.Dense\nimport tfhybrid.layers",
                 {}, used_first),
                # horovod's TensorFlow module touches tf.keras as it loads
                ("import horovod.tensorflow as hvd\nimport tfhybrid.layers", {}, used_first),
                # the user asked for Keras 3 explicitly
                ("import tfhybrid.optimizers", {"TF_USE_LEGACY_KERAS": "0"},
                 "install tf-keras==")):
            out = _run(code, **env)
            self.assertNotEqual(out.returncode, 0, code)
            self.assertIn("ImportError: tfhybrid needs Keras 2 (tf-keras) as tf.keras, "
                          "but tf.keras is Keras '3.", out.stderr)
            self.assertIn(cause, out.stderr)
            self.assertIn("export TF_USE_LEGACY_KERAS=1 before Python starts", out.stderr)

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
