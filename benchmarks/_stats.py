"""Medians with their spread, the one summary every benchmark prints (numpy only, so the
FBGEMM worker's venv can import it too)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class Summary:
    """Order statistics of repeated measurements, in the unit they were given in."""
    median: float
    p25: float
    p75: float
    minimum: float
    maximum: float
    count: int

    def format(self, scale: float = 1.0, digits: int = 2) -> str:
        """'median [p25, p75] (min, max)' with every figure multiplied by `scale`."""
        f = f"{{:.{digits}f}}"
        return (f"{f.format(self.median * scale)} [{f.format(self.p25 * scale)}, "
                f"{f.format(self.p75 * scale)}] ({f.format(self.minimum * scale)}, "
                f"{f.format(self.maximum * scale)})")


SPREAD_LEGEND = "median [p25, p75] (min, max)"


def timed_calls(fn: Callable[[], object], repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after ``warmup`` untimed calls (the
    first traces)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def summarize(samples: Sequence[float]) -> Summary:
    values = np.asarray(samples, dtype=np.float64)
    if values.size == 0:
        raise ValueError("summarize: no samples")
    p25, median, p75 = np.percentile(values, [25, 50, 75])
    return Summary(float(median), float(p25), float(p75), float(values.min()),
                   float(values.max()), int(values.size))


def bootstrap_median_interval(samples: Sequence[float], resamples: int = 2000,
                              seed: int = 12345) -> tuple[float, float]:
    """95% bootstrap interval of the median of `samples`."""
    values = np.asarray(samples, dtype=np.float64)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, (resamples, values.size)), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)
