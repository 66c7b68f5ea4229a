"""Checkpoints of sharded tables that restore onto any mesh, through TensorFlow's own.

- ``resharding``: the geometry of table slices (pure Python, no TensorFlow);
- ``writer``: one checkpoint written by all ranks together, atomically;
- ``pieces``: the rectangles of full-table tensors a rank holds, as saveables;
- ``tables``: a ``DistributedEmbedding``'s tables (and FIITED layouts) in a checkpoint;
- ``slots``: an optimizer's slots of those tables in a checkpoint.

The training app's numbered checkpoints (``tfhybrid.train.checkpoint``) are built on
these; they stay with the app, which knows the model's layers.
"""
