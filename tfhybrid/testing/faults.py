"""Faults that tests inject into training runs and checkpoint saves.

Tests start the work in other processes (``python -m tfhybrid.train`` under
``horovodrun``, or a child of their own), so a fault travels as environment variables:
the ``*_env`` functions return them, to add to the child's environment.

- ``fault_env(rank, step, hang=False)``: rank ``rank`` of a training run raises at the end
  of global training step ``step`` (before any checkpoint of that step); with ``hang``
  it blocks there instead, as a rank stuck in I/O would, so that only the stall shutdown
  can end the job. Reaches the run through its extension point
  (``tfhybrid.train.app.EXTENSIONS_ENV``).
- ``short_input_env(rank, batches)``: rank ``rank``'s training input ends after
  ``batches`` batches, whatever ``--steps`` asks for (input that runs out early on one
  rank).
- ``pause_save_env(save, seconds)``: the ``save``-th coordinated checkpoint save of each
  process sleeps ``seconds`` once the rank has written its part, so a test can kill the
  job in the middle of a save. The child calls ``install_from_env()`` first.

Example::

    from tfhybrid.testing import faults
    env = faults.fault_env(rank=1, step=6, hang=True)
    assert env[faults.FAULT_ENV] == "1:6:hang"
    assert faults.hook(faults.FAULT_ENV, 1, ("hang",), env) == (6, "hang")
    assert faults.hook(faults.FAULT_ENV, 0, ("hang",), env) is None
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Mapping, Sequence

from tfhybrid.train import app as train_app

# "RANK:STEP[:hang]": the fault of fault_env
FAULT_ENV = "TFHYBRID_TEST_FAIL_AT_STEP"
# "RANK:BATCHES": the short input of short_input_env
SHORT_INPUT_ENV = "TFHYBRID_TEST_TRAIN_BATCHES"
# "<n>:<seconds>": the pause of pause_save_env
PAUSE_SAVE_ENV = "TFHYBRID_CHECKPOINT_TEST_PAUSE"
# the mode of a fault that blocks instead of raising
_HANG_MODE = "hang"
# far beyond any stall limit a test sets: the job must end before the hang does
HANG_SECONDS = 3600


def _with_extension(env: dict[str, str]) -> dict[str, str]:
    return {**env, train_app.EXTENSIONS_ENV: __name__}


def fault_env(rank: int, step: int, hang: bool = False) -> dict[str, str]:
    """The environment that makes rank ``rank`` of a training run fail after ``step``."""
    value = f"{rank}:{step}" + (f":{_HANG_MODE}" if hang else "")
    return _with_extension({FAULT_ENV: value})


def short_input_env(rank: int, batches: int) -> dict[str, str]:
    """The environment that ends rank ``rank``'s training input after ``batches``."""
    return _with_extension({SHORT_INPUT_ENV: f"{rank}:{batches}"})


def pause_save_env(save: int, seconds: float) -> dict[str, str]:
    """The environment that pauses a child's ``save``-th coordinated checkpoint save
    (its ``install_from_env()`` reads it)."""
    return {PAUSE_SAVE_ENV: f"{save}:{seconds}"}


def hook(name: str, rank: int, modes: Sequence[str] = (),
         environ: Mapping[str, str] = os.environ) -> tuple[int, str] | None:
    """(NUMBER, MODE) of a fault variable "RANK:NUMBER[:MODE]" naming this rank, or None."""
    value = environ.get(name, "")
    if not value:
        return None
    fields = value.split(":")
    if not (len(fields) in (2, 3) and all(f.isdigit() for f in fields[:2])
            and (len(fields) == 2 or fields[2] in modes)):
        expected = "RANK:NUMBER" + "".join(f"[:{mode}]" for mode in modes)
        raise ValueError(f"{name}={value!r} must be {expected} (a test-only hook)")
    if int(fields[0]) != rank:
        return None
    return int(fields[1]), (fields[2] if len(fields) == 3 else "")


# ------------------------------------------------ the training app's extension
def train_input(dataset: Any, rank: int) -> Any:
    """The app's extension: the training input, cut short on the rank SHORT_INPUT_ENV names."""
    short_input = hook(SHORT_INPUT_ENV, rank)
    return dataset.take(short_input[0]) if short_input else dataset


def train_callbacks(rank: int, first_step: int) -> list:
    """The app's extension: the FAULT_ENV fault on this rank, as a Keras callback."""
    found = hook(FAULT_ENV, rank, modes=(_HANG_MODE,))
    if found is None:
        return []
    fault_step, mode = found
    import tensorflow as tf
    steps = itertools.count(first_step + 1)   # the global step each batch ends

    class InjectedFault(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if next(steps) == fault_step:
                _fail(rank, fault_step, mode)

    return [InjectedFault()]


def _fail(rank: int, step: int, mode: str) -> None:
    # marks the moment of the fault in the log, for a test to time the job's end
    print(f"{FAULT_ENV}: rank {rank} {'hangs' if mode else 'raises'} after step {step}",
          flush=True)
    if mode == _HANG_MODE:
        time.sleep(HANG_SECONDS)
    raise RuntimeError(f"{FAULT_ENV}: fault injected on rank {rank} after step {step}")


# ------------------------------------------------ checkpoint saves
def install_from_env(environ: Mapping[str, str] = os.environ) -> None:
    """Pauses the coordinated save PAUSE_SAVE_ENV names, if it names one (idempotent)."""
    value = environ.get(PAUSE_SAVE_ENV, "")
    if not value:
        return
    save, seconds = value.split(":")
    pause_save(int(save), float(seconds))


_PAUSES: dict[int, float] = {}


def pause_save(save: int, seconds: float) -> None:
    """Sleeps ``seconds`` in this process's ``save``-th coordinated checkpoint save, once
    this rank has written its part (``tfhybrid.checkpoint.writer.add_part_observer``)."""
    from tfhybrid.checkpoint import writer
    _PAUSES[int(save)] = float(seconds)
    writer.add_part_observer(_pause)


def _pause(save: int) -> None:
    if save in _PAUSES:
        time.sleep(_PAUSES[save])
