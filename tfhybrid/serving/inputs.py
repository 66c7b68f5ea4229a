"""A served model's inputs, as its signatures take them and as requests give them.

A signature takes flat, named tensors only (TensorFlow Serving's rule), so an input is
one tensor under its name, except a ragged one (``tf.keras.Input(..., ragged=True)``),
which travels as two: ``{name}.values`` and ``{name}.row_splits`` (int64), the parts a
``tf.RaggedTensor`` of one ragged dimension is made of. The export describes each input
in the manifest (dtype, shape, ``ragged``); the predictor checks a request against that
description and splits its ragged inputs the same way.

Example::

    import numpy as np
    import tensorflow as tf
    from tfhybrid.serving.inputs import request_tensors
    described = {"ids": {"dtype": "int32", "shape": [None, None], "ragged": True}}
    flat = request_tensors(described, {"ids": tf.ragged.constant([[1, 2], [3]])})
    assert flat["ids.values"].tolist() == [1, 2, 3]
    assert flat["ids.row_splits"].tolist() == [0, 2, 3]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

# the parts a ragged input travels as, in a signature and in a request
RAGGED_PARTS = ("values", "row_splits")


def part_name(name: str, part: str) -> str:
    """The signature's name of one part of ragged input ``name``.

    >>> part_name("words", "row_splits")
    'words.row_splits'
    """
    return f"{name}.{part}"


def _each(structure: Any, add: Any) -> Any:
    """``add(dict key or None, leaf)`` over a dict, a list or one input, in its shape."""
    if isinstance(structure, dict):
        return {key: add(key, leaf) for key, leaf in structure.items()}
    if isinstance(structure, (list, tuple)):
        return [add(None, leaf) for leaf in structure]
    return add(None, structure)


def _named_spec(tensor: Any) -> tuple[str, Any]:
    """(name, spec) of a functional model's input tensor: a ``tf.RaggedTensorSpec`` for
    a ragged one (a tf-keras KerasTensor says so by its type spec, Keras 3's by
    ``ragged``)."""
    name = tensor.name.split(":")[0].split("/")[0]
    dtype = tf.as_dtype(tensor.dtype)
    if bool(getattr(tensor, "ragged", False)) or isinstance(
            getattr(tensor, "type_spec", None), tf.RaggedTensorSpec):
        return name, tf.RaggedTensorSpec(tuple(tensor.shape), dtype, ragged_rank=1,
                                         row_splits_dtype=tf.int64)
    return name, tf.TensorSpec(tuple(tensor.shape), dtype, name=name)


class ServedInputs:
    """The inputs of a model's signatures: each dense input as a named ``tf.TensorSpec``,
    each ragged one as its two parts; ``structured(flat)`` rebuilds the model's input
    structure (a dict, a list or one input) from the signature's tensors.

    Args:
      model: a functional Keras model (its inputs are read), or any model when
        ``input_signature`` is given.
      input_signature: named ``tf.TensorSpec`` per input (a structure like the model's
        input), or ``tf.RaggedTensorSpec`` under a dict key for a ragged input.

    Example::

        import tensorflow as tf
        from tfhybrid.serving.inputs import ServedInputs
        ids = tf.keras.Input([None], dtype=tf.int32, ragged=True, name="ids")
        model = tf.keras.Model(ids, tf.keras.layers.Lambda(lambda x: x)(ids))
        served = ServedInputs(model, None)
        assert sorted(served.specs) == ["ids.row_splits", "ids.values"]
    """

    def __init__(self, model: tf.keras.Model, input_signature: Any = None):
        self.specs: dict[str, tf.TensorSpec] = {}
        self.ragged: dict[str, tf.RaggedTensorSpec] = {}
        self.description: dict[str, dict] = {}
        if input_signature is None:
            structure = getattr(model, "input", None) if getattr(model, "inputs", None) \
                else None
            if structure is None:
                raise ValueError("export: the model is not functional, so it has no inputs "
                                 "to read; pass input_signature= (tf.TensorSpec per input, "
                                 "named)")
            # a dict input is named by its key, as Keras feeds it
            self.template = _each(structure, lambda key, tensor: self._add(
                *((key, _named_spec(tensor)[1]) if key else _named_spec(tensor))))
        else:
            self.template = _each(input_signature, lambda key, spec: self._add(
                key or getattr(spec, "name", None), spec))

    def _add(self, name: str | None, spec: Any) -> str:
        """Adds one input; its name."""
        if isinstance(spec, tf.RaggedTensorSpec):
            if not name:
                raise ValueError(f"input_signature: a tf.RaggedTensorSpec ({spec}) needs a "
                                 "name: give the signature as a dict by input name")
            return self._add_ragged(name, spec)
        if not isinstance(spec, tf.TensorSpec) or not name:
            raise ValueError(f"input_signature: {spec!r} is not a named tf.TensorSpec")
        spec = tf.TensorSpec(spec.shape, spec.dtype, name=name)
        self.specs[name] = spec
        self.description[name] = {"dtype": spec.dtype.name, "shape": list(spec.shape),
                                  "ragged": False}
        return name

    def _add_ragged(self, name: str, spec: tf.RaggedTensorSpec) -> str:
        if spec.ragged_rank != 1 or spec.shape.rank != 2:
            raise ValueError(f"export: input {name!r} is ragged with shape {spec.shape} and "
                             f"ragged_rank {spec.ragged_rank}; a served ragged input is "
                             "[batch, None] (one ragged dimension)")
        self.ragged[name] = spec
        self.specs[part_name(name, "values")] = tf.TensorSpec(
            [None], spec.dtype, name=part_name(name, "values"))
        self.specs[part_name(name, "row_splits")] = tf.TensorSpec(
            [None], tf.int64, name=part_name(name, "row_splits"))
        self.description[name] = {"dtype": spec.dtype.name, "shape": list(spec.shape),
                                  "ragged": True}
        return name

    def structured(self, flat: dict) -> Any:
        """The model's input structure from a signature's tensors (by signature name)."""
        def one(name: str) -> Any:
            if name in self.ragged:
                return tf.RaggedTensor.from_row_splits(flat[part_name(name, "values")],
                                                       flat[part_name(name, "row_splits")])
            return flat[name]

        return tf.nest.map_structure(one, self.template)


def _as_ragged_parts(name: str, value: Any, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A request's ragged input (a ``tf.RaggedTensor``, or a list of rows) as (values,
    row_splits); ValueError naming the input if it is neither."""
    if isinstance(value, tf.RaggedTensor):
        if value.ragged_rank != 1 or value.shape.rank != 2:
            raise ValueError(f"inputs[{name!r}] is ragged with shape {value.shape}; the model "
                             "takes [batch, None]")
        values, splits = value.values.numpy(), value.row_splits.numpy()
    elif isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and
                                               value.dtype == object):
        rows = [np.asarray(row).reshape(-1).tolist() for row in value]
        splits = np.cumsum([0] + [len(row) for row in rows])
        # an empty row says nothing of the dtype: the values are read from the others
        flat = [v for row in rows for v in row]
        values = np.asarray(flat) if flat else np.zeros([0], dtype)
    elif isinstance(value, np.ndarray) and value.ndim == 2:
        # a dense batch is a ragged one whose rows have one length
        values = value.reshape(-1)
        splits = np.arange(len(value) + 1) * value.shape[1]
    else:
        raise ValueError(f"inputs[{name!r}] is ragged: give a tf.RaggedTensor or a list of "
                         f"rows; got {type(value).__name__}")
    return _same_kind(name, np.asarray(values), dtype), np.asarray(splits, np.int64)


def _same_kind(name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` as ``dtype`` where that changes no kind (int to int, float to float, str or
    bytes to a string); ValueError naming the input otherwise."""
    if dtype == np.dtype(object) and value.dtype.kind in "USO":
        value = value.astype(object)     # strings, as str or bytes
    if value.dtype != dtype:
        same_kind = (np.issubdtype(value.dtype, np.integer) and
                     np.issubdtype(dtype, np.integer)) or (
            np.issubdtype(value.dtype, np.floating) and np.issubdtype(dtype, np.floating))
        if not same_kind:
            raise ValueError(f"inputs[{name!r}] has dtype {value.dtype}; the model takes "
                             f"{dtype}")
        value = value.astype(dtype)
    return value


def request_tensors(described: dict[str, dict], inputs: Any) -> dict[str, np.ndarray]:
    """A request's inputs checked against the manifest's ``described`` inputs (names,
    dtypes, shapes; ValueError naming a missing, extra or malformed input) and flattened
    as the signatures take them: by name, a ragged input as its two parts. ``inputs``: a
    dict by name, a list in the model's order, or one value for a one-input model."""
    if not isinstance(inputs, dict):
        if len(described) == 1 and not isinstance(inputs, (list, tuple)):
            inputs = {next(iter(described)): inputs}
        elif isinstance(inputs, (list, tuple)):
            if len(inputs) != len(described):
                raise ValueError(f"inputs: got {len(inputs)} inputs; the model takes "
                                 f"{len(described)} ({sorted(described)})")
            inputs = dict(zip(described, inputs))
        else:
            raise ValueError(f"inputs: expected a dict of {sorted(described)}; got "
                             f"{type(inputs).__name__}")
    missing = sorted(set(described) - set(inputs))
    extra = sorted(set(inputs) - set(described))
    if missing or extra:
        raise ValueError(f"inputs: missing {missing}, unexpected {extra}; the model takes "
                         f"{sorted(described)}")
    flat: dict[str, np.ndarray] = {}
    batches: dict[str, int] = {}
    for name, spec in described.items():
        dtype = np.dtype(tf.as_dtype(spec["dtype"]).as_numpy_dtype)
        if spec.get("ragged"):
            values, splits = _as_ragged_parts(name, inputs[name], dtype)
            if values.ndim != 1 or len(splits) < 1 or splits[0] != 0 or \
                    splits[-1] != len(values) or (np.diff(splits) < 0).any():
                raise ValueError(f"inputs[{name!r}]: its rows do not split its "
                                 f"{len(values)} values")
            flat[part_name(name, "values")] = values
            flat[part_name(name, "row_splits")] = splits
            batches[name] = len(splits) - 1
            continue
        value = inputs[name]
        if isinstance(value, tf.RaggedTensor):
            raise ValueError(f"inputs[{name!r}] is ragged; the model takes a dense "
                             f"{spec['shape']} (None: any size)")
        value = _same_kind(name, np.asarray(value), dtype)
        shape = spec["shape"]
        if value.ndim != len(shape) or any(
                want is not None and want != got for want, got in zip(shape, value.shape)):
            raise ValueError(f"inputs[{name!r}] has shape {list(value.shape)}; the model "
                             f"takes {shape} (None: any size)")
        flat[name] = value
        if value.ndim:
            batches[name] = value.shape[0]
    if len(set(batches.values())) > 1:
        raise ValueError(f"inputs: batch sizes differ: {batches}")
    return flat


def batch_size(described: dict[str, dict], flat: dict[str, np.ndarray]) -> int:
    """The batch of a request flattened by ``request_tensors``."""
    for name, spec in described.items():
        if spec.get("ragged"):
            return len(flat[part_name(name, "row_splits")]) - 1
        if flat[name].ndim:
            return flat[name].shape[0]
    return 1
