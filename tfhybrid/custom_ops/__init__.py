"""tfhybrid's fused CPU embedding ops, with pure-TensorFlow fallbacks.

Public API::

    embedding_lookup_combine(params, ids, combiner="sum", table_name="embedding",
                             use_custom_op=None, weights=None) -> tf.Tensor
                             (tf.RaggedTensor for ragged ids with combiner=None)
    embedding_lookup_combine_concat(params_list, ids_list, combiner="sum",
                                    table_names=None, use_custom_op=None) -> tf.Tensor
                             (several tables' bags side by side, one op)
    rowwise_adagrad_apply(var, accum, indices, grad, lr, epsilon, scale=1.0,
                          weight_decay=0.0, use_custom_op=None) -> tf.Operation or None
    custom_ops_available() -> bool
    kernel_isa() -> str             # "generic", "avx2" or "avx512": the kernels' code path
    supported_kernel_isas() -> list[str]

The C++ library ``_tfhybrid_ops.tf<X.Y>.so`` for the running TensorFlow (built by
``python -m tfhybrid.custom_ops.build``; Bazel's ``_tfhybrid_ops.so`` when that is
absent) is loaded lazily on first use. If it is missing or fails to load, one warning is logged
and the pure-TF path is used. ``TFHYBRID_DISABLE_CUSTOM_OPS=1`` forces the pure-TF path.

The library is built for a baseline CPU; its hot loops exist also as AVX2 and AVX-512
code, and each process runs the best level its CPU supports (``cc/kernels/isa_kernels.h``;
every level gives bitwise-identical results). ``TFHYBRID_KERNEL_ISA=generic|avx2|avx512``
(read once per process) forces a lower level; an invalid value, or a level this CPU
lacks, raises ValueError when the library is loaded.

``use_custom_op``: ``None`` picks the op when the library is loaded and the table lives
on a CPU device (an empty device string counts as CPU when no GPU is visible), else the
pure-TF path; ``True`` requires the op (error if unavailable); ``False`` forces pure TF.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

import tensorflow as tf

from tfhybrid import combiners as combiners_lib
# dynamic tables' ops, here by name as every op's wrapper
from tfhybrid.custom_ops.dynamic import (dynamic_find_or_insert, dynamic_held_slots,
                                         dynamic_keyed_rows)

__all__ = ["embedding_lookup_combine", "embedding_lookup_combine_concat",
           "rowwise_adagrad_apply", "custom_ops_available",
           "chunked_lookup", "chunked_rowwise_adagrad_apply",
           "cached_chunked_rowwise_adagrad_apply",
           "kernel_isa", "supported_kernel_isas", "load_library", "library_path",
           "library_name"]

_LOG = logging.getLogger(__name__)
_HERE = Path(__file__).resolve().parent


def library_name(tf_version: str) -> str:
    """The library's file name for a TensorFlow version: TF's C++ ABI changes with its
    minor version, so venvs of two TF versions can share one checkout."""
    major, minor = tf_version.split(".")[:2]
    return f"_tfhybrid_ops.tf{major}.{minor}.so"


def _library_path() -> str:
    versioned = _HERE / library_name(tf.__version__)
    bazel_built = _HERE / "_tfhybrid_ops.so"   # BUILD's name: one TF per Bazel workspace
    return str(versioned if versioned.exists() or not bazel_built.exists() else bazel_built)


library_path = _library_path()

_lock = threading.Lock()
_lib = None
_load_attempted = False
_load_error: str | None = None
_gpu_visible: bool | None = None


def _disabled() -> bool:
    return os.environ.get("TFHYBRID_DISABLE_CUSTOM_OPS", "").strip().lower() in ("1", "true", "yes")


# host-side Python (a lock, a file load): AutoGraph must not convert it inside a traced step
@tf.autograph.experimental.do_not_convert
def load_library():
    """Returns the loaded op module, or None (warning logged once) if unavailable.

    Raises ValueError if TFHYBRID_KERNEL_ISA is invalid or names a level this CPU lacks.
    """
    global _lib, _load_attempted, _load_error
    if _load_attempted:
        return _lib
    with _lock:
        if _load_attempted:
            return _lib
        if _disabled():
            _load_error = "disabled by TFHYBRID_DISABLE_CUSTOM_OPS=1"
            _LOG.info("tfhybrid custom ops %s; using the pure-TF path", _load_error)
        elif not os.path.exists(library_path):
            _load_error = f"{library_path} not found"
            _LOG.warning("tfhybrid custom ops unavailable (%s; build it with `python -m "
                         "tfhybrid.custom_ops.build`); using the pure-TF path", _load_error)
        else:
            try:
                lib = tf.load_op_library(library_path)
            except Exception as e:  # noqa: BLE001 - any load failure means fallback
                _load_error = f"failed to load {library_path}: {e}"
                _LOG.warning("tfhybrid custom ops unavailable (%s; rebuild with `python -m "
                             "tfhybrid.custom_ops.build --force`); using the pure-TF path",
                             _load_error)
            else:
                # A bad TFHYBRID_KERNEL_ISA is a configuration error, not a reason to fall
                # back to the slow path: fail now, naming it (not cached: the next call
                # raises again). A library built before the op existed still works.
                if hasattr(lib, "tfhybrid_kernel_isa"):
                    _isa_info(lib)
                _lib = lib
        _load_attempted = True
        return _lib


def _isa_info(lib):
    """(chosen level, supported levels) from the library's TfhybridKernelIsa op."""
    if not hasattr(lib, "tfhybrid_kernel_isa"):
        raise RuntimeError(f"{library_path} predates kernel dispatch (no TfhybridKernelIsa "
                           "op); rebuild it with `python -m tfhybrid.custom_ops.build --force`")
    with tf.init_scope():  # eager even while a tf.function is being traced
        try:
            isa, supported = lib.tfhybrid_kernel_isa()
        except tf.errors.InvalidArgumentError as e:
            # Keep the kernel's own message, without TF's "{{function_node ...}}" and
            # "[Op:...]" decorations.
            message = re.sub(r"^\{\{.*?\}\}\s*|\s*\[Op:\w+\]$", "", e.message)
            raise ValueError(message) from None
    return isa.numpy().decode(), [s.decode() for s in supported.numpy()]


def kernel_isa() -> str:
    """The instruction-set level of the custom kernels' hot loops in this process:
    "generic" (baseline code), "avx2" or "avx512". Raises RuntimeError if the library
    is unavailable."""
    return _isa_info(require_library())[0]


def supported_kernel_isas() -> list[str]:
    """The levels this CPU supports with this library, lowest first (TFHYBRID_KERNEL_ISA
    may choose any of them). Raises RuntimeError if the library is unavailable."""
    return _isa_info(require_library())[1]


def custom_ops_available() -> bool:
    """True if the C++ library is loaded (and not disabled by the environment)."""
    return load_library() is not None


def load_error() -> str | None:
    """Why the C++ library is not loaded (disabled, missing or failed), or None."""
    load_library()
    return _load_error


def require_library():
    """The loaded C++ library; ``RuntimeError`` saying why when it is unavailable."""
    lib = load_library()
    if lib is None:
        raise RuntimeError(f"tfhybrid custom ops requested but unavailable: {_load_error}")
    return lib


def _no_gpu_visible() -> bool:
    global _gpu_visible
    if _gpu_visible is None:
        _gpu_visible = bool(tf.config.list_logical_devices("GPU"))
    return not _gpu_visible


def _on_cpu(x) -> bool:
    try:
        dev = x.device
    except (AttributeError, RuntimeError, ValueError):
        dev = ""
    if not dev:
        return _no_gpu_visible()
    device_type = tf.DeviceSpec.from_string(dev).device_type
    if device_type is None:
        return _no_gpu_visible()
    return device_type.upper() == "CPU"


def _use_op(use_custom_op, *placed) -> bool:
    if use_custom_op is False:
        return False
    if use_custom_op:
        require_library()
        return True
    return custom_ops_available() and all(_on_cpu(x) for x in placed)


def _variable_accessed(var) -> None:
    """Lets GradientTape / FuncGraph watch `var` when it is read through its handle
    (what ResourceVariable.sparse_read does)."""
    # the door to TF's internals checks tf.keras when imported: only on first use here,
    # so the op library loads without Keras
    from tfhybrid import _tf_internals  # pylint: disable=g-import-not-at-top
    _tf_internals.variable_accessed(var)


def _num_rows(params):
    """Number of table rows, as a Python int when static (never reads the variable)."""
    static = params.shape[0] if params.shape.rank else None
    if static is not None:
        return int(static)
    if isinstance(params, tf.Variable):
        return tf.raw_ops.VariableShape(input=params.handle, out_type=tf.int64)[0]
    return tf.shape(params, out_type=tf.int64)[0]


def _check_in_range(ids, num_rows, prefix: str, what: str):
    """Raises / asserts that every id is in [0, num_rows); the message names the first bad id.

    Returns `ids` (with a control dependency on the check in graph mode).
    """
    ids64 = tf.cast(tf.reshape(ids, [-1]), tf.int64)
    limit = tf.cast(num_rows, tf.int64)
    bad = tf.logical_or(ids64 < 0, ids64 >= limit)
    if tf.executing_eagerly():
        if bool(tf.reduce_any(bad)):
            bad_np = bad.numpy()
            pos = int(bad_np.argmax())
            raise tf.errors.InvalidArgumentError(
                None, None, f"{prefix} got {what} {int(ids64[pos])}, expected {what}s in "
                f"[0, {int(limit)}) (at position {pos})")
        return ids
    first_bad = tf.concat([tf.boolean_mask(ids64, bad)[:1], tf.zeros([1], tf.int64)], 0)[0]
    template = prefix.replace("{", "(").replace("}", ")")
    msg = tf.strings.format(template + " got " + what + " {}, expected " + what + "s in [0, {})",
                            [first_bad, limit])
    check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [msg])
    with tf.control_dependencies([check]):
        return tf.identity(ids)


def _normalize_combiner(combiner) -> str:
    if combiner is None:
        return "none"
    if not isinstance(combiner, str) or combiner.lower() not in (
            ("none",) + combiners_lib.COMBINERS):
        raise ValueError(f"combiner must be None or one of {combiners_lib.COMBINERS}, got "
                         f"{combiner!r}")
    return combiner.lower()


# ----------------------------------------------------------------------------- lookup


@tf.autograph.experimental.do_not_convert
def embedding_lookup_combine(params, ids, combiner="sum", table_name="embedding",
                             use_custom_op=None, weights=None):
    """Fused embedding lookup + combine.

    Args:
      params: [R, D] table, a `tf.Tensor` or `tf.Variable` (float32; float16/bfloat16 ok).
      ids: int ids in [0, R): dense [B] (treated as [B, 1]) or [B, H], or a
        `tf.RaggedTensor` [B, None] (a `tf.SparseTensor` is converted to ragged).
      combiner: "sum", "mean" (sum / max(bag size, 1): an empty bag gives zeros),
        "sqrtn" (sum / sqrt(bag size)), or None (no combine: [B] -> [B, D], [B, H] ->
        [B, H, D], ragged -> ragged [B, None, D]).
      table_name: used in error messages, e.g.
        "embedding table 'user' got id 12345, expected ids in [0, 1000)".
      use_custom_op: None (auto), True or False; see the module docstring.
      weights: None, or float per-id weights of the ids' form and shape, used as given
        and not trained: "sum" is sum(w * row), "mean" that over sum(w), "sqrtn" over
        sqrt(sum(w ** 2)), a zero denominator gives zeros (``tfhybrid.combiners``).

    Returns:
      The combined embeddings, dtype of `params` (accumulated in float32).
      The gradient w.r.t. `params` is a `tf.IndexedSlices` whose indices are the unique
      ids sorted ascending (custom-op path), or the looked-up ids (pure-TF path).
    """
    combiner = _normalize_combiner(combiner)
    with tf.name_scope("embedding_lookup_combine"):
        ids, values, splits, ragged = _normalize_ids(ids)
        if not isinstance(params, tf.Variable):
            params = tf.convert_to_tensor(params)
        if weights is not None and combiner == "none":
            raise ValueError(f"embedding table {table_name!r}: per-id weights need a "
                             "combiner ('sum', 'mean' or 'sqrtn'); got combiner=None")
        if weights is not None:
            weights = _weights_like(weights, ids, ragged, table_name)
        # a kernel sums (weighted, with weights); means and sqrtn with weights, and sqrtn
        # without, divide the sums here, by one rule (tfhybrid.combiners)
        divided_after = combiner == "sqrtn" or (weights is not None and combiner != "sum")
        kernel_combiner = "sum" if divided_after else combiner
        if _use_op(use_custom_op, params):
            out = _lookup_op(params, ids, values, splits, ragged, kernel_combiner, table_name,
                             weights)
        else:
            out = _lookup_pure_tf(params, ids, values, splits, ragged, kernel_combiner,
                                  table_name, weights)
        if not divided_after:
            return out
        bag_splits = _bags(ids, values, splits, ragged)[1]
        return tf.cast(combiners_lib.combined_bags(
            tf.cast(out, tf.float32), combiner, bag_splits[1:] - bag_splits[:-1], weights),
            out.dtype)


def _weights_like(weights, ids, ragged: bool, table_name: str) -> tf.Tensor:
    """The flat float32 per-id weights of normalized ``ids``; ``ValueError`` naming the
    table when their form or shape does not match the ids'."""
    if isinstance(weights, tf.SparseTensor):
        weights = tf.RaggedTensor.from_sparse(weights)
    weights = weights if isinstance(weights, tf.RaggedTensor) else tf.convert_to_tensor(weights)
    if isinstance(weights, tf.RaggedTensor) != ragged or not (
            ragged or weights.shape.is_compatible_with(ids.shape)):
        raise ValueError(f"embedding table {table_name!r}: weights of shape {weights.shape} "
                         f"for ids of shape {ids.shape}; expected the ids' form and shape")
    return tf.cast(weights.flat_values if ragged else tf.reshape(weights, [-1]), tf.float32)


def _normalize_ids(ids):
    """(ids, values, splits, ragged) of a lookup's ids: dense [B] / [B, H] (values and
    splits None) or ragged [B, None] (a SparseTensor becomes ragged), int32 or int64."""
    if isinstance(ids, tf.SparseTensor):
        ids = tf.RaggedTensor.from_sparse(ids)
    ragged = isinstance(ids, tf.RaggedTensor)
    if ragged:
        if ids.ragged_rank != 1 or ids.shape.rank != 2:
            raise ValueError(f"ragged ids must be [B, None], got shape {ids.shape}")
        values, splits = ids.values, ids.row_splits
    else:
        ids = tf.convert_to_tensor(ids)
        if ids.shape.rank not in (1, 2):
            raise ValueError(f"dense ids must be [B] or [B, H], got shape {ids.shape}")
        values, splits = None, None
    id_tensor = values if ragged else ids
    if id_tensor.dtype not in (tf.int32, tf.int64):
        if not id_tensor.dtype.is_integer:
            raise ValueError(f"ids must be integers, got {id_tensor.dtype}")
        id_tensor = tf.cast(id_tensor, tf.int64)
        if ragged:
            values = id_tensor
        else:
            ids = id_tensor
    return ids, values, splits, ragged


@tf.autograph.experimental.do_not_convert
def embedding_lookup_combine_concat(params_list, ids_list, combiner="sum", table_names=None,
                                    use_custom_op=None):
    """Several tables' bags side by side: ``tf.concat([embedding_lookup_combine(p, i,
    combiner) for p, i in zip(params_list, ids_list)], axis=1)`` in one op (FBGEMM's
    table-batched bags), which writes each bag straight into its columns.

    Args:
      params_list: N tables, each [R_t, D_t]; the op needs `tf.Variable`s of one dtype.
      ids_list: N id tensors as in :func:`embedding_lookup_combine`, every one with the
        same number of bags B.
      combiner: "sum" or "mean".
      table_names: N names for error messages (default "embedding_<t>").
      use_custom_op: None (auto), True or False. Tables that are not variables of one
        dtype take the per-table lookups and a concat, with the same result.

    Returns:
      [B, sum of D_t], each table's gradient a `tf.IndexedSlices` as from
      :func:`embedding_lookup_combine`: each table's backward reads its own columns of
      the upstream gradient in place, and a row-wise AdaGrad on it still fuses with the
      backward (:func:`rowwise_adagrad_apply`).

    Example::

        users = tf.Variable(tf.random.normal([1000, 16]))
        items = tf.Variable(tf.random.normal([500, 8]))
        out = embedding_lookup_combine_concat(
            [users, items], [tf.constant([[1, 2], [3, 4]]), tf.constant([[7], [9]])],
            table_names=["users", "items"])   # [2, 24]: users' sums, then items'
    """
    combiner = _normalize_combiner(combiner)
    params_list, ids_list = list(params_list), list(ids_list)
    if not params_list or len(params_list) != len(ids_list):
        raise ValueError(f"embedding_lookup_combine_concat needs one ids tensor per table and at "
                         f"least one table, got {len(params_list)} tables and {len(ids_list)} "
                         "ids tensors")
    if combiner == "none":
        raise ValueError("embedding_lookup_combine_concat combines bags: combiner must be 'sum' "
                         "or 'mean', got None")
    names = (list(table_names) if table_names is not None
             else [f"embedding_{t}" for t in range(len(params_list))])
    if len(names) != len(params_list):
        raise ValueError(f"table_names has {len(names)} names, expected {len(params_list)} "
                         "(one per table)")
    batchable = (all(isinstance(p, tf.Variable) and p.shape.rank == 2
                     and p.shape[1] is not None for p in params_list)
                 and len({getattr(p, "true_dtype", p.dtype) for p in params_list}) == 1)
    if use_custom_op and not batchable:
        raise ValueError("embedding_lookup_combine_concat custom op needs tf.Variable tables "
                         "of one dtype with static widths, got "
                         f"{[(type(p).__name__, p.dtype.name, p.shape) for p in params_list]}")
    # the op sums or averages; sqrtn divides each table's sums afterwards
    if combiner == "sqrtn" or not (batchable and _use_op(use_custom_op, *params_list)):
        return tf.concat([embedding_lookup_combine(p, i, combiner, n, use_custom_op)
                          for p, i, n in zip(params_list, ids_list, names)], axis=1)
    with tf.name_scope("embedding_lookup_combine_concat"):
        bags = [_bags(*_normalize_ids(ids)) for ids in ids_list]
        flats, splits = [b[0] for b in bags], [b[1] for b in bags]
        # one id type and one splits type for all tables
        if len({f.dtype for f in flats}) > 1:
            flats = [tf.cast(f, tf.int64) for f in flats]
        if len({s.dtype for s in splits}) > 1:
            splits = [tf.cast(s, tf.int64) for s in splits]
        for p in params_list:
            _variable_accessed(p)
        var_dtype = getattr(params_list[0], "true_dtype", params_list[0].dtype)
        out = require_library().resource_embedding_lookup_combine_concat(
            [p.handle for p in params_list], flats, splits, dtype=var_dtype,
            combiner=combiner, table_names=names,
            widths=[int(p.shape[1]) for p in params_list])
        if out.dtype != params_list[0].dtype:
            out = tf.cast(out, params_list[0].dtype)
        batch = next((b[2] for b in bags if b[2] is not None), None)
        out.set_shape([batch, sum(int(p.shape[1]) for p in params_list)])
        return out


def _bags(ids, values, splits, ragged):
    """(flat ids, row_splits, static bag count or None) of normalized ids (_normalize_ids),
    for a lookup that combines bags."""
    if ragged:
        return values, splits, ids.shape[0]
    flat, b, h = _dense_layout(ids)
    return flat, tf.range(b + 1, dtype=tf.int64) * tf.cast(h, tf.int64), ids.shape[0]


def _dense_layout(ids):
    """ids [B] or [B, H] -> (flat ids, B, H)."""
    shape = tf.shape(ids, out_type=tf.int64)
    b = shape[0]
    if ids.shape.rank == 1:
        h = 1
    else:
        h = ids.shape[1] if ids.shape[1] is not None else shape[1]
    return tf.reshape(ids, [-1]), b, h


def _weights_input(weights) -> tf.Tensor:
    """The ops' weights input: the per-id weights, or an empty vector for none."""
    return tf.zeros([0], tf.float32) if weights is None else weights


def _lookup_op(params, ids, values, splits, ragged, combiner, table_name, weights=None):
    lib = require_library()
    if combiner == "none" and not ragged:
        flat, bag_splits = tf.reshape(ids, [-1]), tf.zeros([1], tf.int64)  # splits ignored
    else:
        flat, bag_splits, _ = _bags(ids, values, splits, ragged)
    if isinstance(params, tf.Variable):
        _variable_accessed(params)
        # AutoCastVariable (mixed precision) reports its cast dtype; the op reads the
        # stored one and the result is cast like a read of the variable would be.
        var_dtype = getattr(params, "true_dtype", params.dtype)
        out = lib.resource_embedding_lookup_combine(
            params.handle, flat, bag_splits, _weights_input(weights), dtype=var_dtype,
            combiner=combiner, table_name=table_name)
        if out.dtype != params.dtype:
            out = tf.cast(out, params.dtype)
    else:
        out = lib.embedding_lookup_combine(params, flat, bag_splits, _weights_input(weights),
                                           combiner=combiner, table_name=table_name)
    if combiner != "none":
        batch = ids.shape[0]  # static batch size (or None), dense or ragged
        out.set_shape([batch, params.shape[-1] if params.shape.rank == 2 else None])
        return out
    if ragged:
        return tf.RaggedTensor.from_row_splits(out, splits, validate=False)
    out_shape = tf.concat([tf.shape(ids), tf.shape(out)[1:]], 0)
    result = tf.reshape(out, out_shape)
    if params.shape.rank == 2:
        result.set_shape(ids.shape.concatenate(params.shape[1:]))
    return result


def _lookup_pure_tf(params, ids, values, splits, ragged, combiner, table_name,
                    weights=None):
    num_rows = _num_rows(params)
    prefix = f"embedding table '{table_name}'"
    compute_dtype = tf.float32 if params.dtype in (tf.float16, tf.bfloat16) else params.dtype
    if weights is not None:
        # weighted sums (the caller divides): each row times its weight, summed per bag
        flat, bag_splits, _ = _bags(ids, values, splits, ragged)
        flat = _check_in_range(flat, num_rows, prefix, "id")
        rows = tf.cast(tf.gather(params, flat), compute_dtype) * tf.cast(
            weights, compute_dtype)[:, None]
        nbags = tf.shape(bag_splits, out_type=bag_splits.dtype)[0] - 1
        out = tf.math.unsorted_segment_sum(
            rows, tf.ragged.row_splits_to_segment_ids(bag_splits), nbags)
        return tf.cast(out, params.dtype)
    if ragged:
        values = _check_in_range(values, num_rows, prefix, "id")
        rows = tf.gather(params, values)
        if combiner == "none":
            return tf.RaggedTensor.from_row_splits(rows, splits, validate=False)
        rows = tf.cast(rows, compute_dtype)
        nbags = tf.shape(splits, out_type=splits.dtype)[0] - 1
        seg = tf.ragged.row_splits_to_segment_ids(splits)
        out = tf.math.unsorted_segment_sum(rows, seg, nbags)
        if combiner == "mean":
            counts = tf.cast(tf.maximum(splits[1:] - splits[:-1], 1), compute_dtype)
            out = out / counts[:, None]
        return tf.cast(out, params.dtype)
    ids = _check_in_range(ids, num_rows, prefix, "id")
    if combiner == "none":
        return tf.gather(params, ids)
    ids2d = ids if ids.shape.rank == 2 else ids[:, None]
    rows = tf.cast(tf.gather(params, ids2d), compute_dtype)  # [B, H, D]
    out = tf.reduce_sum(rows, axis=1)
    if combiner == "mean":
        h = tf.shape(ids2d)[1]
        out = out / tf.cast(tf.maximum(h, 1), compute_dtype)
    return tf.cast(out, params.dtype)


def _lookup_grad(op, grad, dense_shape):
    lib = require_library()
    if isinstance(grad, tf.IndexedSlices):
        grad = tf.convert_to_tensor(grad)
    combiner = op.get_attr("combiner")
    table_name = op.get_attr("table_name")
    combiner = combiner.decode() if isinstance(combiner, bytes) else combiner
    table_name = table_name.decode() if isinstance(table_name, bytes) else table_name
    num_rows = tf.cast(dense_shape[0], tf.int64)
    # the weights are inputs, not trained: they scale the rows' gradients only
    unique_ids, rows = lib.embedding_lookup_combine_grad(
        grad, op.inputs[1], op.inputs[2], num_rows, op.inputs[3], combiner=combiner,
        table_name=table_name)
    return tf.IndexedSlices(rows, unique_ids, dense_shape)


def _register_gradients():
    def _tensor_grad(op, grad):
        dense_shape = tf.shape(op.inputs[0], out_type=tf.int32)
        return [_lookup_grad(op, grad, dense_shape), None, None, None]

    def _resource_grad(op, grad):
        dense_shape = tf.raw_ops.VariableShape(input=op.inputs[0], out_type=tf.int32)
        return [_lookup_grad(op, grad, dense_shape), None, None, None]

    def _chunked_grad(op, grad):
        # the table's rows: one fewer than its row offsets
        rows = tf.shape(op.inputs[1], out_type=tf.int64)[0] - 1
        unique_ids, values = require_library().embedding_lookup_combine_grad(
            tf.cast(grad, tf.float32), op.inputs[2], op.inputs[3], rows, op.inputs[4],
            combiner="sum", table_name=op.get_attr("table_name").decode())
        dense_shape = tf.stack([tf.cast(rows, tf.int32), op.get_attr("dim")])
        return [tf.IndexedSlices(values, unique_ids, dense_shape), None, None, None, None]

    def _concat_grad(op, grad):
        # each table's backward reads its own columns of the [B, sum D_t] gradient in place
        n = op.get_attr("N")
        widths = op.get_attr("widths")
        names = [x.decode() for x in op.get_attr("table_names")]
        combiner = op.get_attr("combiner").decode()
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.convert_to_tensor(grad)
        grads, first = [], 0
        for t in range(n):
            dense_shape = tf.raw_ops.VariableShape(input=op.inputs[t], out_type=tf.int32)
            unique_ids, rows = require_library().embedding_lookup_combine_grad(
                grad, op.inputs[n + t], op.inputs[2 * n + t],
                tf.cast(dense_shape[0], tf.int64), _weights_input(None), combiner=combiner,
                table_name=names[t], grad_columns=[first, first + widths[t]])
            grads.append(tf.IndexedSlices(rows, unique_ids, dense_shape))
            first += widths[t]
        return grads + [None] * (2 * n)

    for name, fn in (("EmbeddingLookupCombine", _tensor_grad),
                     ("ResourceEmbeddingLookupCombineConcat", _concat_grad),
                     ("ResourceEmbeddingLookupCombine", _resource_grad),
                     ("ChunkedEmbeddingLookupCombine", _chunked_grad)):
        try:
            tf.RegisterGradient(name)(fn)
        except KeyError:  # already registered (module re-imported)
            pass
    for name in ("EmbeddingLookupCombineGrad", "RowwiseAdagradApply", "TfhybridKernelIsa"):
        try:
            tf.no_gradient(name)
        except KeyError:
            pass


_register_gradients()


# ----------------------------------------------------------------------------- optimizer


@tf.autograph.experimental.do_not_convert
def rowwise_adagrad_apply(var, accum, indices, grad, lr, epsilon, scale=1.0, weight_decay=0.0,
                          use_custom_op=None):
    """Sparse exact row-wise Adagrad step (FBGEMM EXACT_ROWWISE_ADAGRAD), in place.

    Duplicate `indices` are summed first (in input order; deterministic). Then for each
    distinct row i with summed float32 gradient g (D = row width):

        accum[i] += mean_j(g_j ** 2)
        var[i]   -= lr * g / (sqrt(accum[i] / scale) + epsilon)
        if weight_decay > 0:
            var[i] -= lr * weight_decay * var[i]   # decoupled decay, AFTER the step above,
                                                   # touched rows only

    Args:
      var: float32 [R, D] `tf.Variable`; accum: float32 [R] `tf.Variable`.
      indices: int32/int64 [N] in [0, R); grad: [N, D] float32/float16/bfloat16.
      lr, epsilon, scale, weight_decay: scalars (float32).
      use_custom_op: None (auto), True or False; see the module docstring.

    In a tf.function, when (indices, grad) are exactly the gradient of the custom-op
    lookup (:func:`embedding_lookup_combine`) of ``var``, float32, the backward and this
    update run as one kernel with the same result (``_lookup_grad_op``).

    Returns:
      The update `tf.Operation` in graph mode (tf.function), None in eager mode.
    """
    if not isinstance(var, tf.Variable) or not isinstance(accum, tf.Variable):
        raise TypeError("rowwise_adagrad_apply: var and accum must be tf.Variable")
    with tf.name_scope("rowwise_adagrad_apply"):
        indices = tf.convert_to_tensor(indices)
        if indices.dtype not in (tf.int32, tf.int64):
            indices = tf.cast(indices, tf.int64)
        grad = tf.convert_to_tensor(grad)
        scalars = [tf.cast(x, tf.float32) for x in (lr, epsilon, scale, weight_decay)]
        op_ok = (var.dtype == tf.float32 and accum.dtype == tf.float32
                 and grad.dtype in (tf.float32, tf.float16, tf.bfloat16))
        if use_custom_op and not op_ok:
            raise ValueError("rowwise_adagrad_apply custom op needs float32 var/accum and "
                             f"float32/float16/bfloat16 grad; got {var.dtype}, {accum.dtype}, "
                             f"{grad.dtype}")
        if op_ok and _use_op(use_custom_op, var, accum):
            lookup_grad = _lookup_grad_op(indices, grad)
            if lookup_grad is not None:
                return require_library().embedding_lookup_combine_grad_rowwise_adagrad(
                    var.handle, accum.handle, *lookup_grad.inputs[:3], *scalars,
                    lookup_grad.inputs[4],
                    combiner=lookup_grad.get_attr("combiner"),
                    table_name=lookup_grad.get_attr("table_name"),
                    grad_columns=lookup_grad.get_attr("grad_columns"))
            return require_library().rowwise_adagrad_apply(var.handle, accum.handle, indices, grad,
                                                        *scalars)
        return _rowwise_adagrad_pure_tf(var, accum, indices, grad, *scalars)


def _lookup_grad_op(indices, grad) -> tf.Operation | None:
    """The EmbeddingLookupCombineGrad op whose outputs are exactly (indices, grad), when
    the update can take that op's inputs instead: in a graph (tf.function), for a float32
    gradient. The update then runs as one fused kernel, bitwise equal to the two, and the
    [U, D] gradient rows between them are never written (the unused backward op is pruned
    from the function). A gradient changed on its way (clipped, unscaled, summed across
    replicas) comes from another op and takes the two-kernel route."""
    if tf.executing_eagerly():
        return None
    op = getattr(grad, "op", None)
    if (op is None or op.type != "EmbeddingLookupCombineGrad" or grad.value_index != 1
            or getattr(indices, "op", None) is not op or indices.value_index != 0
            or grad.dtype != tf.float32):
        return None
    return op


def chunked_lookup(pool, row_offsets, ids, dim: int, use_custom_op=None):
    """FIITED's pool lookup in C++ (``tfhybrid.fiited.ChunkedTable`` owns the pure-TF
    path): [N, dim] rows, each row's chunks then zeros. None when the op is not to be
    used (``use_custom_op`` False, or None and the op is not built or not on a CPU)."""
    if not _use_op(use_custom_op, pool):
        return None
    return require_library().chunked_embedding_lookup(pool, row_offsets, ids, dim=dim)


def custom_op_used(use_custom_op, *placed) -> bool:
    """Whether a kernel of this library runs for tensors/variables ``placed``, given a
    ``use_custom_op`` of None (auto), True (required: raises when not built) or False."""
    return _use_op(use_custom_op, *placed)


def chunked_lookup_combine(pool, row_offsets, ids, row_splits, dim: int,
                           table_name: str = "embedding", weights=None):
    """FIITED's bags in C++: [B, dim] sums of the rows of ``ids`` ([N]) in the bags
    ``row_splits`` ([B + 1]), read from the pool variable in place. Its gradient (below)
    reaches ``pool`` as ``tf.IndexedSlices`` at the distinct logical ids, ascending, each
    row's gradient summed in input order: the dense op's backward kernel, since a bag
    sum's gradient does not depend on how the rows are stored. ``weights``: per-id
    weights (each row times its weight). The caller chooses the path
    (:func:`custom_op_used`)."""
    _variable_accessed(pool)
    return require_library().chunked_embedding_lookup_combine(
        pool.handle, row_offsets, ids, tf.cast(row_splits, tf.int64), _weights_input(weights),
        dim=dim, table_name=table_name)


def chunked_rowwise_adagrad_apply(pool, accum, row_offsets, indices, grad, lr, epsilon,
                                  scale, weight_decay, utility, utility_decay):
    """FIITED's row-wise AdaGrad on a pool variable in C++, with the utility update
    (every entry times ``utility_decay``, then each distinct row's plus
    ``(1 - utility_decay)`` times its summed gradient's squared norm). The caller
    chooses the path (:func:`custom_op_used`)."""
    return require_library().chunked_rowwise_adagrad_apply(
        pool.handle, accum.handle, row_offsets, indices,
        *_chunked_update_inputs(grad, lr, epsilon, scale, weight_decay, utility,
                                utility_decay))


def cached_chunked_rowwise_adagrad_apply(cache, accum, slot_chunks, slot_rows, chunk_dim: int,
                                         indices, grad, lr, epsilon, scale, weight_decay,
                                         utility, utility_decay):
    """:func:`chunked_rowwise_adagrad_apply` on a tiered FIITED table's cache
    (``tfhybrid.tiers.ChunkedCachedTable``): ``indices`` are cache slots, slot i holds row
    ``slot_rows[i]`` with its first ``slot_chunks[i]`` chunks; ``utility`` has one entry
    per row of the table. The caller chooses the path (:func:`custom_op_used`)."""
    return require_library().cached_chunked_rowwise_adagrad_apply(
        cache.handle, accum.handle, slot_chunks, slot_rows, indices,
        *_chunked_update_inputs(grad, lr, epsilon, scale, weight_decay, utility,
                                utility_decay),
        chunk_dim=chunk_dim)


def _chunked_update_inputs(grad, lr, epsilon, scale, weight_decay, utility,
                           utility_decay) -> list:
    """The inputs both FIITED update ops take after their ids: the gradient, the AdaGrad
    scalars, the utility and its decay and weight (``1 - decay``)."""
    return ([tf.cast(grad, tf.float32)]
            + [tf.cast(x, tf.float32) for x in (lr, epsilon, scale, weight_decay)]
            + [utility.handle, tf.constant(utility_decay, tf.float32),
               tf.constant(1.0 - utility_decay, tf.float32)])


def coalesce_rows(indices, grad):
    """(ascending distinct indices [U], float32 gradient rows summed per index [U, D]).

    A stable sort first, so duplicates are summed in input order: deterministic."""
    g = tf.cast(grad, tf.float32)
    order = tf.argsort(indices, stable=True)
    unique_idx, seg = tf.unique(tf.gather(indices, order))  # ascending, since sorted
    return unique_idx, tf.math.segment_sum(tf.gather(g, order), seg)


def rowwise_adagrad_rows(rows, accum_rows, g, mean_square, lr, epsilon, scale, weight_decay):
    """The row-wise AdaGrad step of distinct rows: (new rows, new accumulators).

    ``mean_square`` is each row's mean of g**2 over the entries it holds (all of them for
    a dense table; the present chunks for a FIITED one)."""
    v = accum_rows + mean_square
    mult = lr / (tf.sqrt(v / scale) + epsilon)
    w = tf.cast(rows, tf.float32) - mult[:, None] * g
    decay = tf.where(weight_decay > 0, lr * weight_decay, 0.0)
    return w - decay * w, v


def _rowwise_adagrad_pure_tf(var, accum, indices, grad, lr, epsilon, scale, weight_decay):
    indices = _check_in_range(indices, _num_rows(var), "rowwise_adagrad_apply", "index")
    unique_idx, g = coalesce_rows(indices, grad)
    w, v = rowwise_adagrad_rows(tf.gather(var, unique_idx), tf.gather(accum, unique_idx), g,
                                tf.reduce_mean(tf.square(g), axis=1), lr, epsilon, scale,
                                weight_decay)
    update_accum = tf.raw_ops.ResourceScatterUpdate(resource=accum.handle, indices=unique_idx,
                                                    updates=tf.cast(v, accum.dtype))
    update_var = tf.raw_ops.ResourceScatterUpdate(resource=var.handle, indices=unique_idx,
                                                  updates=tf.cast(w, var.dtype))
    if tf.executing_eagerly():
        return None
    return tf.group(update_accum, update_var)
