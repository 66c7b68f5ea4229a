"""Keras layers: ``Embedding`` (with a combiner), ``DistributedEmbedding``, ``XlaCompiled``,
``DynamicEmbedding`` (open-world keys, in one process)."""

from tfhybrid import _tf_internals  # noqa: F401 - first: checks which Keras tf.keras is
from tfhybrid.layers.embedding import Embedding
from tfhybrid.layers.distributed_embedding import DistributedEmbedding
from tfhybrid.layers.xla import XlaCompiled
from tfhybrid.layers.dynamic_embedding import DynamicEmbedding
# distributed-embeddings' `distributed_embeddings.python.layers.embedding` names.
from tfhybrid.layers.embedding import CPUInitializer
from tfhybrid.layers.concat_one_hot import ConcatEmbedding, ConcatOneHotEmbedding
from tfhybrid.layers.integer_lookup import IntegerLookup

__all__ = ["Embedding", "DistributedEmbedding", "XlaCompiled", "DynamicEmbedding"]
__all__ += ["CPUInitializer", "ConcatOneHotEmbedding", "ConcatEmbedding", "IntegerLookup"]
