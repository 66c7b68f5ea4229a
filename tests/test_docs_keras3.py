"""Every Python block of README.md and docs/ runs with Keras 3 as tf.keras, as in Keras 2.

``tests/test_docs.py`` runs the blocks as a reader would with the Keras the suite runs
(Keras 2 in ``make test``); this runs them again with TF_USE_LEGACY_KERAS unset: what a
TensorFlow >= 2.16 user who did not opt into tf-keras has, Keras 3. The quick start, the
three training styles, the distributed-embeddings migration and every capability page's
example are among them.
"""

import unittest

from tests import test_docs

KERAS = (3,)
STARTS_JOBS = True   # the 2 x 2 blocks are horovodrun jobs


class DocsKeras3Test(unittest.TestCase):

    def test_every_block_runs_in_keras_3(self):
        blocks = [b for path in test_docs.doc_files() for b in test_docs.parse(path).blocks]
        self.assertGreaterEqual(len([b for b in blocks if not b.skip]), 10,
                                [b.name for b in blocks])
        test_docs.check_blocks(self, blocks, legacy_keras=None)


if __name__ == "__main__":
    unittest.main()
