"""Keras layers: ``Embedding`` (with a combiner), ``DistributedEmbedding``, ``XlaCompiled``."""

from tfhybrid.layers.embedding import Embedding
from tfhybrid.layers.distributed_embedding import DistributedEmbedding
from tfhybrid.layers.xla import XlaCompiled

__all__ = ["Embedding", "DistributedEmbedding", "XlaCompiled"]
