"""The served copy of a model: ``ServedTables``, a ``DistributedEmbedding``'s stand-in
of plain TensorFlow lookups, and how the export's signatures trace it.

A signature traces the copy in one of three modes (``tracing_mode``): ``"inline"`` looks
every table up; ``"ids"`` hands out the ids each external feature looks up (the
``feature_ids`` signature; ``id_columns`` lays dense features side by side, and
``id_sources`` walks the traced graph back to the inputs the ids are columns of);
``"external"`` takes external features' rows from the rows a predictor fetched
(``external_rows``). Bags combine by the training rule (``tfhybrid.combiners``), with
per-id weights where the model passes them.

Example::

    import numpy as np
    import tensorflow as tf
    from tfhybrid.serving.served_copy import ServedTables
    layer = ServedTables("emb", {0: np.ones([5, 2], np.float32)}, [(0, "mean", 2, False)],
                         "float32")
    (out,) = layer([(tf.constant([[1, 2]]), tf.constant([[1.0, 3.0]]))])
    assert out.numpy().tolist() == [[1.0, 1.0]]
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from tfhybrid.combiners import combined_bags, normalized_weights
from tfhybrid.serving import manifest as manifest_lib
from tfhybrid.sharding.bags import ids_and_weights
from tfhybrid.sharding.tables import ids_as_int64

# what a ServedTables call does, set while a signature traces: look every table up
# ("inline"), take external features' rows from the given dict ("external"), or hand
# out the ids external features look up ("ids")
MODE_VAR: "contextvars.ContextVar[tuple[str, dict] | None]" = contextvars.ContextVar(
    "tfhybrid_serving_mode", default=None)


@contextlib.contextmanager
def tracing_mode(kind: str, values: dict):
    """Traces the served copy in mode ``kind`` with ``values`` (module docstring)."""
    token = MODE_VAR.set((kind, values))
    try:
        yield
    finally:
        MODE_VAR.reset(token)


def _combine(combiner: str | None, gathered: Any, ids_rank: int, weights: Any = None
             ) -> Any:
    """A bag's gathered rows ([bags, hotness, width], dense or ragged) combined as the
    model's table combines them, with per-id ``weights`` (of the ids' form) or without:
    the one rule of ``tfhybrid.combiners``, in the stock TensorFlow ops it traces to."""
    if combiner is None:
        return gathered
    if ids_rank == 1:
        # one id per example: a bag of one, its weight still counts (a sum scales by it)
        return gathered if weights is None else _weighted(combiner, gathered[:, None, :],
                                                          weights[:, None])
    if weights is not None:
        return _weighted(combiner, gathered, weights)
    if isinstance(gathered, tf.RaggedTensor):
        return combined_bags(tf.reduce_sum(gathered, axis=1), combiner,
                             gathered.row_lengths())
    # a bag is the ids' last dimension, as the layers combine them
    sums = tf.reduce_sum(gathered, axis=-2)
    shape = tf.shape(gathered)
    bags = tf.reshape(sums, [-1, shape[-1]])
    combined = combined_bags(bags, combiner, tf.fill(tf.shape(bags)[:1], shape[-2]))
    return tf.reshape(combined, tf.shape(sums))


def _weighted(combiner: str, gathered: Any, weights: Any) -> Any:
    """Σ w·e of each bag, with a ``mean`` or ``sqrtn`` bag's weights first divided by its
    divisor (ids of weight <= 0 dropped), as training's layers weigh them."""
    weights = tf.cast(weights, gathered.dtype)
    if isinstance(gathered, tf.RaggedTensor):
        if combiner != "sum":
            weights = normalized_weights(combiner, tf.ragged.map_flat_values(
                lambda w: tf.where(w > 0, w, tf.zeros_like(w)), weights))
        return tf.reduce_sum(gathered.with_values(
            gathered.values * weights.values[:, None]), axis=1)
    shape = tf.shape(gathered)
    bags = tf.reshape(weights, [-1, shape[-2]])
    if combiner != "sum":
        bags = normalized_weights(combiner, tf.where(bags > 0, bags, tf.zeros_like(bags)))
    rows = tf.reshape(gathered, [-1, shape[-2], shape[-1]])
    sums = tf.reduce_sum(rows * bags[:, :, None], axis=1)
    return tf.reshape(sums, tf.concat([shape[:-2], shape[-1:]], 0))


def id_columns(shapes: Mapping[str, Any]) -> dict[str, tuple[int, int, list[int]]]:
    """Each external feature's columns ``[start, stop)`` in ``feature_ids``' one ids
    matrix and its ids' shape past the batch, from the ids' shapes (in order)."""
    columns, start = {}, 0
    for key, shape in shapes.items():
        tail = list(tf.TensorShape(shape)[1:])
        if any(d is None for d in tail):
            raise ValueError(f"export: feature {key} looks up ids of shape {list(shape)}; "
                             "a served external feature needs a fixed shape past the batch")
        width = int(np.prod(tail, dtype=np.int64))
        columns[key] = (start, start + width, [int(d) for d in tail])
        start += width
    return columns


# ops an input passes through on its way to a table that leave its ids as they are
_SAME_IDS_OPS = ("Identity", "Snapshot", "StopGradient")


def _id_source(tensor: tf.Tensor, inputs: dict) -> dict | None:
    """Where a traced feature's ids come from, if they are one model input as is or
    some of its columns: ``{"input": name, "unpacked": [[axis, index], ...]}`` (each
    ``tf.unstack`` on the way, outermost first); None for anything else (the ids are
    computed, and only the SavedModel's ``feature_ids`` gives them)."""
    unpacked: list[list[int]] = []
    while True:
        op = tensor.op
        if op.type in _SAME_IDS_OPS:
            tensor = op.inputs[0]
        elif op.type == "Cast":
            source = op.inputs[0].dtype
            # integers widen to int64 exactly; anything else is a computation
            if not (source.is_integer and source != tf.uint64):
                return None
            tensor = op.inputs[0]
        elif op.type == "Unpack":
            rank = op.inputs[0].shape.rank
            axis = op.get_attr("axis")
            if rank is None:
                return None
            axis = axis % rank
            if axis == 0:       # along the batch: not the ids of each example
                return None
            unpacked.insert(0, [axis, tensor.value_index])
            tensor = op.inputs[0]
        elif op.type == "Placeholder" and tensor.ref() in inputs:
            if not tensor.dtype.is_integer:
                return None
            return {"input": inputs[tensor.ref()], "unpacked": unpacked}
        else:
            return None


def id_sources(traced: Any, keys: list[str], ragged_keys: list[str]
               ) -> dict[str, dict] | None:
    """Each external feature's ids as columns of a model input (``_id_source``; a ragged
    feature's as its input's values), from the traced function that hands the ids out,
    if every feature's are: the predictor then reads them from the request itself, with
    no call of ``feature_ids``. None otherwise."""
    specs = tf.nest.flatten(traced.structured_input_signature)
    inputs = {t.ref(): spec.name for t, spec in zip(traced.graph.inputs, specs)}
    outputs = traced.structured_outputs
    found = {key: _id_source(outputs[key], inputs) for key in keys}
    found.update({key: _id_source(outputs[key].values, inputs) for key in ragged_keys})
    return None if any(source is None for source in found.values()) else found


class ServedTables(tf.keras.layers.Layer):
    """A ``DistributedEmbedding``'s stand-in in the served copy: plain TF lookups.

    ``tables`` holds each inline table's whole float32 values (a dynamic table's as
    ``(keys, rows)``: the sorted keys, searched by ``tf.searchsorted``, find a key's row,
    and a key it does not hold reads the default row); ``features`` lists per input feature
    ``(table index, combiner, width, external)``; ``dynamic`` maps a dynamic table's
    index to ``(its TableSpec, default_row)``; ``dtype_out`` is the original layer's
    compute dtype. Made by ``export``; not trained.

    Example::

        import numpy as np
        import tensorflow as tf
        from tfhybrid.serving.served_copy import ServedTables
        layer = ServedTables("emb", {0: np.ones([5, 2], np.float32)},
                             [(0, "sum", 2, False)], "float32")
        (out,) = layer([tf.constant([[1, 2]])])
        assert out.numpy().tolist() == [[2.0, 2.0]]
    """

    def __init__(self, source_name: str, tables: Mapping[int, Any],
                 features: list[tuple[int, str | None, int, bool]], dtype_out: str,
                 dynamic: Mapping[int, tuple[Any, tuple]] | None = None, **kwargs: Any):
        super().__init__(name=f"served_{source_name}", trainable=False, **kwargs)
        self.source_name = source_name
        self.features = list(features)
        self.dtype_out = dtype_out
        self.keyed_tables = dict(dynamic or {})
        variables, key_variables = {}, {}
        for t, values in tables.items():
            if t in self.keyed_tables:
                keys, rows = values
                order = np.argsort(np.asarray(keys, np.int64), kind="stable")
                default = np.asarray(self.keyed_tables[t][1], np.float32)[None]
                # row len(keys), the default row, is what a key without a row reads
                values = np.concatenate([np.asarray(rows, np.float32).reshape(
                    len(order), default.shape[1])[order], default])
                key_variables[t] = tf.Variable(np.asarray(keys, np.int64)[order],
                                               trainable=False, name=f"{source_name}_keys_{t}")
            variables[t] = tf.Variable(np.asarray(values, np.float32), trainable=False,
                                       name=f"{source_name}_table_{t}")
        # plain variables, kept past Keras' tracking: export's module saves them
        object.__setattr__(self, "table_variables", variables)
        object.__setattr__(self, "key_variables", key_variables)

    def _rows_of_keys(self, table: int, keys: Any) -> Any:
        """Each key's row in an inline dynamic table: its place among the sorted held keys
        (``tf.searchsorted``), or the default row after them where it is not held."""
        held = self.key_variables[table]
        count = tf.shape(held, out_type=tf.int64)[0]
        flat = tf.reshape(keys, [-1])
        at = tf.searchsorted(held, flat, out_type=tf.int64)
        found = tf.equal(tf.gather(held, tf.minimum(at, tf.maximum(count - 1, 0))), flat)
        found = tf.logical_and(found, at < count)
        return tf.reshape(tf.where(found, at, count), tf.shape(keys))

    def _stand_in(self, ids: Any, combiner: str | None, width: int) -> Any:
        """Zeros of a feature's output shape, while ``feature_ids`` traces."""
        if isinstance(ids, tf.RaggedTensor):
            if combiner:
                return tf.zeros(tf.stack([ids.nrows(), width]), self.dtype_out)
            return ids.with_values(tf.zeros(tf.stack([tf.size(ids.values), width]),
                                            self.dtype_out))
        kept = tf.shape(ids)[:-1] if combiner and ids.shape.rank > 1 else tf.shape(ids)
        return tf.zeros(tf.concat([kept, [width]], 0), self.dtype_out)

    def _ids(self, table: int, feature: int, ids: Any) -> Any:
        """A feature's ids as int64: a dynamic table's as its keys (strings by their
        fingerprint, the training rule, in stock ops)."""
        if table in self.keyed_tables:
            return tf.ragged.map_flat_values(
                lambda values: ids_as_int64(self.keyed_tables[table][0], feature, values), ids)
        return tf.cast(ids, tf.int64)

    def call(self, inputs, weights=None):
        ids_list, weights = ids_and_weights(
            list(inputs) if isinstance(inputs, (list, tuple)) else [inputs], weights)
        mode, values = MODE_VAR.get() or ("inline", {})
        outputs = []
        for f, (ids, weight) in enumerate(zip(ids_list, weights)):
            table, combiner, width, external = self.features[f]
            key = manifest_lib.feature_key(self.source_name, f)
            if external and mode == "ids":
                values[key] = self._ids(table, f, ids)
                outputs.append(self._stand_in(ids, combiner, width))
                continue
            if external and mode == "external" and key in values["ragged"]:
                rows = tf.gather(values["rows"], values["ragged"][key])[:, :width]
                bags = tf.RaggedTensor.from_row_splits(rows, ids.row_splits, validate=False)
                outputs.append(tf.cast(_combine(combiner, bags, 2, weight), self.dtype_out))
                continue
            if external and mode == "external":
                tail = values["columns"][key][2]
                rows = values["pieces"][key]          # [batch, its columns, row width]
                if width != values["row_width"]:
                    rows = rows[:, :, :width]
                rows = tf.reshape(rows, [-1] + tail + [width])
                outputs.append(tf.cast(_combine(combiner, rows, len(tail) + 1, weight),
                                       self.dtype_out))
                continue
            if table in self.key_variables:
                ids = tf.ragged.map_flat_values(lambda keys: self._rows_of_keys(table, keys),
                                                self._ids(table, f, ids))
            gathered = tf.gather(self.table_variables[table], ids)
            outputs.append(tf.cast(_combine(combiner, gathered, ids.shape.rank, weight),
                                   self.dtype_out))
        return outputs

    def compute_output_shape(self, input_shape):
        shapes = input_shape if isinstance(input_shape, list) else [input_shape]
        out = []
        for f, shape in enumerate(shapes):
            _, combiner, width, _ = self.features[f]
            if shape and isinstance(shape[0], (list, tuple, tf.TensorShape)):
                shape = shape[0]      # an (ids, weights) pair: the ids' shape
            shape = tuple(shape)
            keep = shape if combiner is None or len(shape) == 1 else shape[:-1]
            out.append(tuple(keep) + (width,))
        return out
