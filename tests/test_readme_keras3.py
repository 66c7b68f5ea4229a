"""README.md's Python blocks run with Keras 3 as tf.keras, as in Keras 2.

``tests/test_docs.py`` runs every block of README.md and docs/ as a reader would, with the
Keras the suite runs; this runs README's blocks (the quick start, the three training
styles, the distributed-embeddings migration) again with TF_USE_LEGACY_KERAS unset: what
a TensorFlow >= 2.16 user who did not opt into tf-keras has, Keras 3.
"""

import shutil
import tempfile
import unittest

from tests import test_docs

KERAS = (3,)
STARTS_JOBS = True   # the 2 x 2 block is a horovodrun job


class ReadmeKeras3Test(unittest.TestCase):

    def test_readme_blocks_run_in_keras_3(self):
        parsed = test_docs.parse("README.md")
        blocks = [block for block in parsed.blocks if not block.skip]
        self.assertGreaterEqual(len(blocks), 3, [b.name for b in blocks])
        workdir = tempfile.mkdtemp(prefix="tfhybrid-readme-")
        self.addCleanup(shutil.rmtree, workdir, ignore_errors=True)
        for block in blocks:
            with self.subTest(block=block.name):
                outcome = test_docs.run_block(block, workdir, legacy_keras=None)
                self.assertEqual(outcome.returncode, 0,
                                 f"{block.name} under Keras 3: exit code "
                                 f"{outcome.returncode}\n{test_docs.tail(outcome.stderr)}")


if __name__ == "__main__":
    unittest.main()
