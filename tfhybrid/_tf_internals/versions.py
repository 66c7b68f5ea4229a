"""The TensorFlow and Keras this process runs, and the versions the hooks were written
for: ``TF_VERSION``, ``KERAS_MAJOR`` / ``KERAS_3``, ``check_version``."""

from __future__ import annotations

import os
import sys

import tensorflow as tf


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


TF_VERSION = _version(tf.__version__)


# The TensorFlow versions every hook below was written for and tested on (2.15 and 2.21,
# with the switches between them); another version may have moved what they patch.
HOOKS_WRITTEN_FOR = ((2, 15), (2, 21))


def _keras_major() -> int:
    """The major version of the Keras that ``tf.keras`` is: 2 (tf-keras, or TF <= 2.15's
    own) or 3. TF >= 2.16 picks Keras 3 unless ``TF_USE_LEGACY_KERAS`` is set before its
    first use of ``tf.keras``; that choice is the user's. Any other Keras is refused here,
    naming it, rather than failing far from the cause."""
    # tf.keras of TF <= 2.15 has no __version__; the package defining its Model has
    package = sys.modules[tf.keras.Model.__module__.split(".")[0]]
    version = getattr(tf.keras, "__version__", None) or getattr(package, "__version__", "")
    major = version.split(".")[0]
    if major not in ("2", "3"):
        raise ImportError(
            f"tfhybrid runs with Keras 2 (tf-keras) or Keras 3 as tf.keras, but tf.keras is "
            f"Keras {version!r} (TensorFlow {tf.__version__}); TF_USE_LEGACY_KERAS is "
            f"{os.environ.get('TF_USE_LEGACY_KERAS')!r}")
    return int(major)


# Which Keras tf.keras is: every difference between Keras 2 and 3 that tfhybrid meets is
# switched on this, in this package or in a store's variable access.
KERAS_MAJOR = _keras_major()


KERAS_3 = KERAS_MAJOR == 3


def hooks_written_for_this_tf() -> bool:
    """Whether this TensorFlow is one the hooks were written for."""
    low, high = HOOKS_WRITTEN_FOR
    return low <= TF_VERSION <= high


def check_version(hook: str) -> None:
    """Refuses to patch a TensorFlow the hook was not written for."""
    low, high = HOOKS_WRITTEN_FOR
    if not hooks_written_for_this_tf():
        raise RuntimeError(
            f"tfhybrid's {hook} hook patches TensorFlow's private structures and was "
            f"written for TensorFlow {low[0]}.{low[1]} to {high[0]}.{high[1]}; this is "
            f"TensorFlow {tf.__version__}, where they may differ")
