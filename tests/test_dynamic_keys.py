"""tfhybrid.dynamic's keys and initial rows, against references in plain Python ints
and floats (no TensorFlow, no shared helper): the mixer, the owner of a key, string keys
and the row each key starts from."""

import inspect
import math
import textwrap

import numpy as np
import tensorflow as tf

import tfhybrid  # noqa: F401 - before tf.keras is used: checks which Keras it is
from tfhybrid import dynamic
from tfhybrid import custom_ops
from tfhybrid.dynamic import KeyedInitializer, initial_rows, keys as keys_lib

# the mixer and the rows are plain TF ops: the same in both Kerases
KERAS = (2, 3)

WORD = (1 << 64) - 1


def mix_reference(key: int) -> int:
    """splitmix64's finalizer, written out on Python ints."""
    z = key & WORD
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & WORD
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & WORD
    return z ^ (z >> 31)


def uniform_reference(seed: int, key: int, j: int) -> float:
    golden = 0x9E3779B97F4A7C15
    state = mix_reference((key & WORD) ^ mix_reference((seed + golden) & WORD))
    bits = mix_reference((state + (j + 1) * golden) & WORD)
    return (bits >> 11) / float(1 << 53)


def row_reference(kind: str, low: float, high: float, seed: int, key: int, dim: int):
    if kind == "constant":
        return [low] * dim
    if kind == "uniform":
        return [low + (high - low) * uniform_reference(seed, key, j) for j in range(dim)]
    return [low + high * math.sqrt(-2.0 * math.log1p(-uniform_reference(seed, key, 2 * j)))
            * math.cos(2.0 * math.pi * uniform_reference(seed, key, 2 * j + 1))
            for j in range(dim)]


KEYS = [0, 1, -1, 2, 7, -(1 << 63), (1 << 63) - 1, 123456789012345, -987654321]


class KeysTest(tf.test.TestCase):

    def test_mix64_is_splitmix64s_finalizer(self):
        rng = np.random.default_rng(0)
        keys = KEYS + [int(k) for k in rng.integers(-(1 << 63), (1 << 63) - 1, 200,
                                                    dtype=np.int64)]
        got = keys_lib.mix64(tf.constant(keys, tf.int64)).numpy()
        self.assertEqual([int(g) for g in got], [mix_reference(k) for k in keys])
        # splitmix64's first output from state 0 is this finalizer of its increment
        self.assertEqual(int(keys_lib.mix64(tf.constant([0x9E3779B97F4A7C15], tf.uint64))[0]),
                         0xE220A8397B1DCDAF)

    def test_every_key_has_one_owner_in_each_group_size(self):
        keys = KEYS + list(range(100, 164))
        for positions in (1, 2, 3, 4, 7):
            got = dynamic.owner_of(tf.constant(keys, tf.int64), positions).numpy().tolist()
            self.assertEqual(got, [mix_reference(k) % positions for k in keys], positions)
        # consecutive keys spread over the positions
        owners = dynamic.owner_of(tf.range(4000, dtype=tf.int64), 4).numpy()
        self.assertTrue(all(900 < n < 1100 for n in np.bincount(owners, minlength=4)))

    def test_bad_group_sizes_and_key_types_are_named(self):
        for positions in (0, -2, 2.0, True):
            with self.assertRaisesRegex(ValueError, rf"positions must be an int >= 1.*"
                                                    rf"{positions!r}"):
                dynamic.owner_of(tf.constant([1], tf.int64), positions)
        with self.assertRaisesRegex(ValueError, "must be int64.*int32"):
            dynamic.mix64(tf.constant([1], tf.int32))
        with self.assertRaisesRegex(ValueError, "takes strings; got int64"):
            dynamic.string_keys(tf.constant([1], tf.int64))

    def test_string_keys_are_tensorflows_fingerprint64(self):
        strings = tf.constant([["a", "bc", ""], ["a", "0x1f", "user:42"]])
        got = dynamic.string_keys(strings)
        self.assertEqual(got.shape, (2, 3))
        self.assertEqual(got.dtype, tf.int64)
        self.assertEqual(int(got[0, 0]), int(got[1, 0]))
        # to_hash_bucket_fast is Fingerprint64 modulo its buckets
        buckets = (1 << 63) - 1
        want = tf.strings.to_hash_bucket_fast(strings, buckets).numpy()
        for g, w in zip(got.numpy().ravel(), want.ravel()):
            self.assertEqual((int(g) & WORD) % buckets, int(w))


class InitialRowsTest(tf.test.TestCase):

    def test_rows_are_the_documented_function_of_seed_and_key(self):
        cases = [("uniform", -0.05, 0.05, 0), ("uniform", -1.0, 3.0, 12345),
                 ("normal", 0.0, 0.05, 7), ("normal", 1.5, 2.0, -3), ("constant", 0.25, 0.0, 1)]
        paths = [False] + ([True] if custom_ops.custom_ops_available() else [])
        for kind, low, high, seed in cases:
            init = KeyedInitializer(kind, low, high, seed)
            want = np.array([row_reference(kind, low, high, seed, k, 6) for k in KEYS])
            for use_custom_op in paths:   # the C++ DynamicKeyedRows and TF's ops
                got = init.rows(tf.constant(KEYS, tf.int64), 6, use_custom_op).numpy()
                self.assertEqual(got.dtype, np.float32)
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-6,
                                           err_msg=f"{kind} custom op {use_custom_op}")

    def test_the_kernel_draws_what_the_tf_ops_draw_bit_for_bit(self):
        custom_ops.require_library()
        keys = tf.constant(np.random.default_rng(4).integers(-2**63, 2**63 - 1, 3000),
                           tf.int64)
        for init in (KeyedInitializer("uniform", -0.05, 0.05, 0),
                     KeyedInitializer("normal", 0.1, 0.3, 2**64 - 5)):
            np.testing.assert_array_equal(init.rows(keys, 16, use_custom_op=True),
                                          init.rows(keys, 16, use_custom_op=False),
                                          err_msg=init.kind)

    def test_a_keys_row_depends_on_nothing_else(self):
        init = KeyedInitializer.of("normal", seed=5)
        together = init.rows(tf.constant([3, 8, -1, 3], tf.int64), 8).numpy()
        alone = init.rows(tf.constant([-1], tf.int64), 8).numpy()
        np.testing.assert_array_equal(together[2], alone[0])
        np.testing.assert_array_equal(together[0], together[3])
        # another seed, another row
        other = KeyedInitializer.of("normal", seed=6).rows(tf.constant([-1], tf.int64), 8)
        self.assertFalse(np.array_equal(other.numpy()[0], alone[0]))
        # an empty list of keys
        self.assertEqual(init.rows(tf.zeros([0], tf.int64), 8).shape, (0, 8))

    def test_draws_have_their_distributions_moments(self):
        keys = tf.range(-5000, 5000, dtype=tf.int64)
        uniform = KeyedInitializer.of(tf.keras.initializers.RandomUniform(-1.0, 1.0),
                                      seed=1).rows(keys, 8).numpy()
        self.assertTrue((uniform >= -1.0).all() and (uniform < 1.0).all())
        self.assertLess(abs(uniform.mean()), 0.01)
        self.assertLess(abs(uniform.var() - 1.0 / 3.0), 0.01)
        normal = KeyedInitializer.of(tf.keras.initializers.RandomNormal(2.0, 0.5),
                                     seed=1).rows(keys, 8).numpy()
        self.assertLess(abs(normal.mean() - 2.0), 0.01)
        self.assertLess(abs(normal.std() - 0.5), 0.01)

    def test_keras_initializers_and_names_map_to_their_kinds(self):
        cases = [("zeros", KeyedInitializer("constant", 0.0, 0.0, 4)),
                 ("ones", KeyedInitializer("constant", 1.0, 0.0, 4)),
                 (0.5, KeyedInitializer("constant", 0.5, 0.0, 4)),
                 ("uniform", KeyedInitializer("uniform", -0.05, 0.05, 4)),
                 ("normal", KeyedInitializer("normal", 0.0, 0.05, 4)),
                 (tf.keras.initializers.Zeros(), KeyedInitializer("constant", 0.0, 0.0, 4)),
                 (tf.keras.initializers.Constant(2.0), KeyedInitializer("constant", 2.0, 0.0, 4)),
                 (tf.keras.initializers.RandomUniform(-2.0, 2.0),
                  KeyedInitializer("uniform", -2.0, 2.0, 4)),
                 # an initializer's own seed replaces the table's
                 (tf.keras.initializers.RandomNormal(0.0, 1.0, seed=9),
                  KeyedInitializer("normal", 0.0, 1.0, 9))]
        for given, want in cases:
            got = KeyedInitializer.of(given, seed=4)
            self.assertEqual(got, want, given)
            self.assertEqual(KeyedInitializer(**got.get_config()), got)

    def test_an_initializer_that_needs_a_shape_is_refused_by_name(self):
        for given in (tf.keras.initializers.GlorotUniform(), tf.keras.initializers.HeNormal(),
                      tf.keras.initializers.Orthogonal()):
            with self.assertRaisesRegex(ValueError, rf"got {type(given).__name__} \(its "
                                                    r"values depend on the table's shape"):
                KeyedInitializer.of(given)
        for given in ("glorot_uniform", None, tf.keras.initializers.TruncatedNormal()):
            with self.assertRaisesRegex(ValueError, "expected 'zeros', a number"):
                KeyedInitializer.of(given)
        with self.assertRaisesRegex(ValueError, "kind='laplace' is unknown"):
            KeyedInitializer("laplace")
        with self.assertRaisesRegex(ValueError, "low must be a finite number; got nan"):
            KeyedInitializer("uniform", float("nan"), 1.0)

    def test_examples_run(self):
        for obj in (dynamic, keys_lib, initial_rows, KeyedInitializer):
            doc = inspect.getdoc(obj)
            self.assertIn("Example::", doc, obj)
            exec(textwrap.dedent(doc.split("Example::", 1)[1]), {})  # pylint: disable=exec-used


if __name__ == "__main__":
    tf.test.main()
