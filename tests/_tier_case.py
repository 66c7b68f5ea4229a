"""What the tier's distributed tests share: the case, its training and the checks."""

import shutil
import tempfile

import horovod.tensorflow as hvd
import tensorflow as tf

import tfhybrid
from tfhybrid import mesh as mesh_lib
from tfhybrid.pipeline import TrainPipeline
from tests import _hybrid_case as hc

# Per step the global batch (4 samples) names up to 12 distinct ids of "wide" and "bag"
# and 8 of "rows" (all may fall in one row shard); a cache holds the rows of two steps
# (a pipeline loads a batch's rows while the step before runs on its own), about what
# these caches hold, so rows keep moving.
CACHE_ROWS = {"wide": 24, "rows": 32, "bag": 24}
STEPS = 10


def case(world, seed, steps=STEPS, store_dir=None):
    return hc.Case(hc.PLACEMENT_TABLES, local_batch=1, steps=steps, world=world, seed=seed,
                   cache_rows=CACHE_ROWS if store_dir else None, store_dir=store_dir)


def trained(case, mesh, make_optimizer, pipeline=False, model=None, callbacks=None,
             **layer_kwargs):
    if model is None:
        model, layer = case.distributed_model(mesh, **layer_kwargs)
        model.compile(optimizer=tfhybrid.DistributedOptimizer(make_optimizer()),
                      loss=hc.loss_fn)
    if pipeline:
        TrainPipeline(model)
    ids, labels = case.local_data(mesh.rank)
    history = model.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0,
                        callbacks=callbacks)
    return model, history.history["loss"]


class SaveAfterBatches(tf.keras.callbacks.Callback):
    """Saves a checkpoint after each of ``batches`` (its flush writes every used cached
    row back) and keeps the weights each one holds."""

    def __init__(self, batches, directory):
        super().__init__()
        self.batches, self.directory = batches, directory
        self.saved = {}   # checkpoint path -> the weights saved

    def on_train_batch_end(self, batch, logs=None):
        if batch in self.batches:
            path = tf.train.Checkpoint(model=self.model).save(f"{self.directory}/ckpt")
            self.saved[path] = weights(self.model)


def layer_of(model):
    return next(layer for layer in model.layers
                if isinstance(layer, tfhybrid.layers.DistributedEmbedding))


def weights(model):
    return hc.table_weights(layer_of(model)) + hc.dense_weights(model)


def tiered_by_key(layer) -> dict:
    """This rank's tiered shards of ``layer``, by "<table>_<shard>"."""
    # a tiered store counts its cache's hits, and has Keras track its table
    return {f"{t}_{s}": store.tracked for (t, s), store in layer.stores.items()
            if "hits" in store.stats()}


def tiered(layer) -> list:
    return list(tiered_by_key(layer).values())


class TierDir(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix="tfhybrid-tiers-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def fresh_dir(self):
        return tempfile.mkdtemp(dir=self.dir)

    def shared_dir(self):
        """One directory for every rank: all ranks write one checkpoint together."""
        path = hvd.broadcast_object(tempfile.mkdtemp(prefix="tfhybrid-tier-ckpt-")
                                    if hvd.rank() == 0 else None)
        self.addCleanup(lambda: hvd.rank() == 0 and shutil.rmtree(path, True))
        return path

    def assert_same(self, got, want):
        self.assertEqual(len(got), len(want))
        for g, w in zip(got, want):
            self.assertAllEqual(g, w)
