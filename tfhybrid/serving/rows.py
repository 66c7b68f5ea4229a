"""How a served table's rows are stored: one Redis value per row (or column slice).

- ``float32``: the row's values, little-endian (4 bytes each);
- ``float16``: the same in half precision (2 bytes each);
- ``int8``: FBGEMM's fused 8-bit rows, row-wise: per row, ``scale = (max - min) / 255``,
  ``offset = min``, ``q = round((x - offset) / scale)`` in [0, 255], stored as the
  ``width`` bytes of ``q`` then ``scale`` and ``offset`` as float32 (``width + 8``
  bytes). A row dequantizes to ``q * scale + offset``, within ``scale / 2`` of the
  trained value; a constant row has scale 0 and dequantizes to itself exactly.

A value is always a whole row, so a reader never sees half of one. NumPy only (the
predictor's process needs neither Horovod nor tfhybrid's ops).

Example::

    import numpy as np
    from tfhybrid.serving.rows import decode, encode, value_bytes
    rows = np.array([[0.0, 1.0, 0.5], [2.0, 2.0, 2.0]], np.float32)
    values = encode(rows, "int8")
    assert len(values[0]) == value_bytes(3, "int8") == 11
    back = decode(values, 3, "int8")
    assert np.abs(back - rows).max() <= 0.5 / 255 + 1e-7 and back[1].tolist() == [2.0] * 3
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

PRECISIONS = ("float32", "float16", "int8")

# int8 rows: the quantized bytes, then scale and offset (float32 each)
_INT8_TAIL = np.dtype([("scale", "<f4"), ("offset", "<f4")])


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; ValueError naming it otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
    return precision


def value_bytes(width: int, precision: str) -> int:
    """Bytes of one stored row (or slice) of ``width`` values, without its key.

    >>> [value_bytes(16, p) for p in PRECISIONS]
    [64, 32, 24]
    """
    check_precision(precision)
    return {"float32": 4 * width, "float16": 2 * width, "int8": width + 8}[precision]


def quantize_int8(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q uint8 [n, w], scale float32 [n], offset float32 [n]) of float ``rows``."""
    rows = np.asarray(rows, np.float32)
    low = rows.min(axis=1) if rows.shape[1] else np.zeros([len(rows)], np.float32)
    high = rows.max(axis=1) if rows.shape[1] else low
    scale = ((high - low) / np.float32(255)).astype(np.float32)
    # a constant row: scale 0, every q 0, dequantized to its offset exactly
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.rint((rows - low[:, None]) / safe[:, None])
    return np.clip(q, 0, 255).astype(np.uint8), scale, low.astype(np.float32)


def encode_matrix(rows: np.ndarray, precision: str) -> np.ndarray:
    """The stored values of float ``rows`` [n, width] as one uint8 array [n, value bytes]:
    row i holds row i's value, so a writer frames them all at once.

    >>> encode_matrix(np.ones([2, 3], np.float32), "float16").shape
    (2, 6)
    """
    check_precision(precision)
    rows = np.ascontiguousarray(rows, np.float32)
    n = len(rows)
    if precision == "int8":
        q, scale, offset = quantize_int8(rows)
        tail = np.empty([n], _INT8_TAIL)
        tail["scale"], tail["offset"] = scale, offset
        return np.concatenate([q, tail.view(np.uint8).reshape(n, 8)], axis=1)
    packed = rows.astype("<f4" if precision == "float32" else "<f2").view(np.uint8)
    return packed.reshape(n, value_bytes(rows.shape[1], precision))


def values_of(matrix: np.ndarray) -> list[bytes]:
    """One stored value (bytes) per row of an encoded ``matrix`` (:func:`encode_matrix`)."""
    buffer = np.ascontiguousarray(matrix, np.uint8).tobytes()
    size = matrix.shape[1]
    return [buffer[i * size:(i + 1) * size] for i in range(len(matrix))]


def encode(rows: np.ndarray, precision: str) -> list[bytes]:
    """One stored value per row of float ``rows`` [n, width]."""
    return values_of(encode_matrix(rows, precision))


def decode(values: Sequence[bytes], width: int, precision: str) -> np.ndarray:
    """float32 [n, width] of stored ``values`` (each exactly one row; ValueError if not)."""
    check_precision(precision)
    size = value_bytes(width, precision)
    if any(len(v) != size for v in values):
        bad = next(len(v) for v in values if len(v) != size)
        raise ValueError(f"a stored row has {bad} bytes; a {precision} row of width "
                         f"{width} has {size}")
    raw = np.frombuffer(b"".join(values), np.uint8).reshape(len(values), size)
    if precision == "int8":
        tail = raw[:, width:].copy().view(_INT8_TAIL).reshape(len(values))
        return (raw[:, :width].astype(np.float32) * tail["scale"][:, None]
                + tail["offset"][:, None]).astype(np.float32)
    dtype = "<f4" if precision == "float32" else "<f2"
    return raw.copy().view(dtype).reshape(len(values), width).astype(np.float32)
