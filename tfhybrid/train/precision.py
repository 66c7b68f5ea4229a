"""Which compute precision is fast here: the app measures it instead of assuming it.

16-bit compute pays only where the machine's 16-bit GEMMs are faster than its float32
ones: GPUs with tensor cores, CPUs with AMX. On CPUs without (AVX-512 or AVX2 only),
TensorFlow 2.15's bfloat16 GEMMs run at about half the float32 speed and its float16 ones
far slower, so ``--mixed_precision=bf16`` would slow training down. The app therefore
times one GEMM of the towers' widest layer in float32 and in the 16-bit type (rank 0 does,
and every rank takes its figures, so all ranks compute alike), then

- ``--mixed_precision=bf16`` / ``fp16``: runs as asked, and says how much slower it will
  be when the 16-bit GEMM is slower;
- ``--mixed_precision=auto``: bfloat16 where its GEMM is faster, float32 elsewhere.

16-bit *communication* with float32 compute is its own option
(``--communication=float16``): it halves the alltoall and allreduce bytes without
slowing the GEMMs.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

# The app's --mixed_precision values that name a 16-bit compute type, and their dtypes.
HALF_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
# A 16-bit GEMM below this share of float32's speed counts as slower (timing noise
# aside); "auto" takes bfloat16 only above FASTER.
SLOWER, FASTER = 0.95, 1.05


@dataclasses.dataclass(frozen=True)
class GemmSpeed:
    """Median times of one ``[m, k] x [k, n]`` GEMM in float32 and in ``dtype``."""
    dtype: str
    shape: tuple[int, int, int]
    float32_ms: float
    half_ms: float

    @property
    def ratio(self) -> float:
        """The 16-bit GEMM's speed as a multiple of float32's (> 1: faster)."""
        return self.float32_ms / self.half_ms

    def describe(self) -> str:
        m, k, n = self.shape
        return (f"a {m}x{k} by {k}x{n} GEMM took {self.half_ms:.2f} ms in {self.dtype} "
                f"against {self.float32_ms:.2f} ms in float32 here ({self.ratio:.2f}x "
                "float32's speed)")


def measure_gemm(dtype: str, m: int, k: int, n: int, repeats: int = 7) -> GemmSpeed:
    """Times a ``[m, k] x [k, n]`` GEMM in float32 and in ``dtype`` (median of
    ``repeats`` runs each, after one warm-up run), interleaved so that a passing load
    hits both alike."""
    import tensorflow as tf
    if dtype not in HALF_DTYPES.values():
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(HALF_DTYPES.values())}")
    for name, value in (("m", m), ("k", k), ("n", n), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    rng = np.random.default_rng(0)
    a = tf.constant(rng.standard_normal((m, k), dtype=np.float32))
    b = tf.constant(rng.standard_normal((k, n), dtype=np.float32))
    operands = {"float32": (a, b), dtype: (tf.cast(a, dtype), tf.cast(b, dtype))}
    gemm = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y)[:1, :1],
                                                           tf.float32)))
    times: dict[str, list[float]] = {name: [] for name in operands}
    for attempt in range(repeats + 1):
        for name, (x, y) in operands.items():
            start = time.perf_counter()
            gemm(x, y).numpy()    # .numpy() waits for the result
            if attempt:           # the first run traces and warms up
                times[name].append(time.perf_counter() - start)
    return GemmSpeed(dtype, (m, k, n), 1e3 * float(np.median(times["float32"])),
                     1e3 * float(np.median(times[dtype])))


def choose(requested: str, speed: GemmSpeed | None) -> tuple[str, str | None]:
    """(the --mixed_precision to run, a note for the user or None) given what was asked
    and the measured ``speed`` of the 16-bit GEMM (bfloat16's for ``"auto"``)."""
    if requested == "none":
        return "none", None
    if speed is None:
        raise ValueError(f"--mixed_precision={requested!r} needs a measured GEMM speed")
    if requested == "auto":
        if speed.ratio >= FASTER:
            return "bf16", f"--mixed_precision=auto: bf16, since {speed.describe()}"
        return "none", (f"--mixed_precision=auto: float32, since {speed.describe()}; "
                        "--communication=float16 still halves the collectives' bytes")
    if requested not in HALF_DTYPES:
        raise ValueError(f"--mixed_precision={requested!r} is unknown; expected none, "
                         f"{', '.join(HALF_DTYPES)} or auto")
    if speed.ratio < SLOWER:
        return requested, (
            f"warning: --mixed_precision={requested} will be slower than float32 on this "
            f"machine: {speed.describe()}. For 16-bit collectives with float32 compute "
            "use --communication=float16 (or --mixed_precision=auto)")
    return requested, None
