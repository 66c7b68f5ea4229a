"""The hooks of tfhybrid's one door to TF's private structures (tfhybrid/_tf_internals/):
each installs only when called, once however often it is called, and refuses a
TensorFlow it was not written for, naming the version and the hook."""

from __future__ import annotations

import os
import subprocess
import sys
import unittest
from unittest import mock

import tensorflow as tf
from tensorflow.python.checkpoint import functional_saver
from tensorflow.python.checkpoint import restore as restore_lib

from tfhybrid import _tf_internals
from tfhybrid._tf_internals import versions
from tfhybrid.checkpoint import writer


# the hooks are written for both Kerases
KERAS = (2, 3)


def _never(*args) -> None:
    del args


class HooksTest(unittest.TestCase):

    def test_importing_tfhybrid_patches_nothing(self):
        script = (
            "import tensorflow as tf\n"
            "from tensorflow.python.checkpoint import functional_saver, restore\n"
            "from tensorflow.python.autograph.core import config\n"
            "def patchable():\n"
            "    return (functional_saver.MultiDeviceSaver.save,\n"
            "            restore.CheckpointPosition.gather_ops_or_named_saveables,\n"
            "            vars(tf.keras.optimizers.Optimizer).get('add_variable_from_reference'),\n"
            "            vars(tf.keras.optimizers.Optimizer).get('build'),\n"
            "            tf.keras.Model.make_train_function, config.CONVERSION_RULES)\n"
            "before = patchable()\n"
            "import tfhybrid, tfhybrid.layers, tfhybrid.tiers, tfhybrid.distributed\n"
            "import tfhybrid.train.checkpoint, tfhybrid.pipeline, tfhybrid.optimizers\n"
            "after = patchable()\n"
            "print('SAME' if all(a is b for a, b in zip(before, after)) else 'PATCHED')\n")
        env = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=300)
        self.assertIn("SAME", out.stdout, out.stderr[-3000:])

    def test_every_hook_is_idempotent(self):
        writer.install()
        saved = functional_saver.MultiDeviceSaver.save
        writer.install()
        self.assertIs(functional_saver.MultiDeviceSaver.save, saved)
        with self.assertRaisesRegex(RuntimeError, "hooked already"):
            _tf_internals.install_saver_hook(_never)

        _tf_internals.install_restore_hook()
        gather = restore_lib.CheckpointPosition.gather_ops_or_named_saveables
        _tf_internals.install_restore_hook()
        self.assertIs(restore_lib.CheckpointPosition.gather_ops_or_named_saveables, gather)

        _tf_internals.install_slot_guard(_never)
        # the class that defines the factory (Keras 3: a base of tf.keras's Optimizer)
        owner = next(k for k in tf.keras.optimizers.Optimizer.__mro__
                     if "add_variable_from_reference" in vars(k))
        factory = vars(owner)["add_variable_from_reference"]
        _tf_internals.install_slot_guard(_never)
        self.assertIs(vars(owner)["add_variable_from_reference"], factory)

        optimizer = tf.keras.optimizers.Adam()
        calls = []

        def after_build() -> None:
            calls.append("built")

        _tf_internals.install_build_hook(optimizer, after_build)
        build = optimizer.build
        _tf_internals.install_build_hook(optimizer, after_build)
        self.assertIs(optimizer.build, build)
        optimizer.build([tf.Variable([1.0])])
        self.assertEqual(calls, ["built"])

        _tf_internals.install_autograph_rule()
        from tensorflow.python.autograph.core import config
        rules = config.CONVERSION_RULES
        _tf_internals.install_autograph_rule()
        self.assertIs(config.CONVERSION_RULES, rules)
        self.assertTrue(any(r.matches("tfhybrid") for r in rules
                            if isinstance(r, config.DoNotConvert)))

    def test_the_train_function_swap_is_undone_only_by_its_own_make(self):
        model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
        keras_make = model.make_train_function
        made = []

        def make(own_make, force):
            made.append(own_make)
            return "ours"

        _tf_internals.replace_make_train_function(model, make)
        self.assertIsNone(model.train_function)
        self.assertEqual(model.make_train_function(), "ours")
        self.assertEqual(model.train_function, "ours")
        self.assertEqual(made, [keras_make])
        ours = model.make_train_function

        def falls_back(own_make, force):
            return own_make(force=force)

        # a second swap falls back on the first; undoing the first does nothing then
        _tf_internals.replace_make_train_function(model, falls_back)
        self.assertEqual(model.make_train_function(), "ours")
        _tf_internals.restore_make_train_function(model, make)
        self.assertNotEqual(model.make_train_function, ours)
        _tf_internals.restore_make_train_function(model, falls_back)
        self.assertEqual(model.make_train_function, ours)
        _tf_internals.restore_make_train_function(model, make)
        self.assertEqual(model.make_train_function, keras_make)

    def test_a_swap_that_falls_back_on_keras_keeps_fit_working(self):
        # Keras 3's own make_train_function sets model.train_function and returns None
        model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.1), "mse")
        _tf_internals.replace_make_train_function(
            model, lambda own_make, force: own_make(force=force))
        history = model.fit(tf.ones([4, 2]), tf.ones([4, 1]), batch_size=2, verbose=0)
        self.assertEqual(len(history.history["loss"]), 1)

    def test_a_hook_refuses_a_tensorflow_it_was_not_written_for(self):
        installs = {"MultiDeviceSaver.save": lambda: _tf_internals.install_saver_hook(_never),
                    "CheckpointPosition.gather_ops_or_named_saveables":
                        _tf_internals.install_restore_hook,
                    "slot factory": lambda: _tf_internals.install_slot_guard(_never),
                    "optimizer build": lambda: _tf_internals.install_build_hook(
                        tf.keras.optimizers.SGD(), lambda: None),
                    "make_train_function": lambda: _tf_internals.replace_make_train_function(
                        tf.keras.Sequential(), lambda own, force: own)}
        for version in ((2, 14), (2, 22), (3, 0)):
            with mock.patch.object(versions, "TF_VERSION", version):
                # a speed-up only: making a layer never fails for it
                _tf_internals.install_autograph_rule()
                for hook, install in installs.items():
                    with self.assertRaisesRegex(
                            RuntimeError, rf"{hook}.*TensorFlow 2\.15 to 2\.21.*this is "
                                          rf"TensorFlow {tf.__version__}"):
                        install()


if __name__ == "__main__":
    unittest.main()
