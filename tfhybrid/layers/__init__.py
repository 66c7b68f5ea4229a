"""Keras layers: ``Embedding`` (with a combiner) and ``DistributedEmbedding``."""

from tfhybrid.layers.embedding import Embedding
from tfhybrid.layers.distributed_embedding import DistributedEmbedding

__all__ = ["Embedding", "DistributedEmbedding"]
