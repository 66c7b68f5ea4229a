"""keras-rs's embedding API on tfhybrid's mesh ([docs/keras-rs.md](../../docs/keras-rs.md)).

A Keras 3 model written with ``keras_rs.layers.DistributedEmbedding`` shards its tables
over the D x M mesh with one import changed: ``from tfhybrid.keras_rs import
DistributedEmbedding``. keras-rs itself is not needed at run time: its
``FeatureConfig`` / ``TableConfig`` objects are read by their attributes, and
:class:`FeatureConfig` / :class:`TableConfig` here are stand-ins with the same fields.
``configs`` reads and checks the configs; ``table_optimizer`` turns the tables' optimizers
into the embedding optimizer (``table_optimizers="honour"``); ``layer`` is the layer.
"""

from tfhybrid.keras_rs.configs import FeatureConfig, TableConfig
from tfhybrid.keras_rs.layer import DistributedEmbedding

__all__ = ["DistributedEmbedding", "FeatureConfig", "TableConfig"]
