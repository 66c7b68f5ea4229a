"""The training application: one process or a horovodrun job, from a ``TrainConfig``.

``python -m tfhybrid.train`` (``tfhybrid/train/__main__.py``) turns absl flags into a
``TrainConfig`` and calls ``run``. ``run`` builds the mesh, the sharded input, the model
and the distributed optimizer, trains with ``model.fit``, evaluates exactly over all
ranks (AUC, log loss), and saves, restores and exports as asked. Rank 0 prints. It is
one module because ``run`` is one sequence a reader follows top to bottom; its parts
(models, data, checkpoints, metrics, precision) live in the modules beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import sys
import threading
import time
from typing import Any, Sequence

from tfhybrid import mesh as mesh_lib
from tfhybrid.plan.types import OPTIMIZERS, REPLICA_SYNC  # pure modules: no TF import
from tfhybrid.serving.rows import PRECISIONS as EXPORT_PRECISIONS
from tfhybrid.serving.store import RedisStore
from tfhybrid.train import data as data_lib
from tfhybrid.train import dynamic_tables

MIXED_PRECISION = {"none": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}
# --mixed_precision: a policy above, or "auto": bf16 where its GEMMs are faster than
# float32's here, else float32 (tfhybrid/train/precision.py)
PRECISION_CHOICES = (*MIXED_PRECISION, "auto")
# what the collectives carry: float16 sends the lookups' activations and their gradients
# (alltoall) and the gradient allreduces as float16 while the model computes in float32
COMMUNICATION = ("float32", "float16")
# where --export_dir's tables go (tfhybrid.serving.export's ``tables``)
EXPORT_TABLES = ("inline", "external")
LAYOUTS = mesh_lib.LAYOUTS
# TrainConfig field -> the Horovod variable it sets before hvd.init
STALL_FLAGS = {"stall_check_seconds": mesh_lib.STALL_CHECK_ENV,
               "stall_shutdown_seconds": mesh_lib.STALL_SHUTDOWN_ENV}
# the text of the error every pending collective gets once Horovod has shut down
_HOROVOD_SHUT_DOWN = "Horovod has been shut down"

# The run's extension point: modules named here (comma-separated) are imported by the
# run; each may define ``train_input(dataset, rank) -> dataset`` (wraps the training
# input, before it is prefetched) and ``train_callbacks(rank, first_step) -> list`` (Keras
# callbacks, run right after the input check). tfhybrid.testing.faults injects faults
# this way; a run without the variable has no extension.
EXTENSIONS_ENV = "TFHYBRID_TRAIN_EXTENSIONS"


@dataclasses.dataclass
class TrainConfig:
    """Everything one run needs; the CLI flags map one to one onto these fields."""
    model: str = "dlrm"
    dataset: str = "synthetic"
    data_dir: str | None = None
    model_parallel: int | None = None          # None: every rank in one model group
    layout: str = "model_major"
    replica_sync: str = "gradients"
    sync_every: int = 1
    optimizer: str = "sgd"
    learning_rate: float = 0.1
    # separate optimizers for the embedding tables and the dense layers; None: --optimizer
    # and --learning_rate for both
    embedding_optimizer: str | None = None
    embedding_learning_rate: float | None = None
    dense_optimizer: str | None = None
    dense_learning_rate: float | None = None
    mixed_precision: str = "none"
    communication: str = "float32"
    count_traffic: bool = False                # bytes each rank's collectives send
    # DCT (tfhybrid.compression): None leaves that half of the traffic uncompressed
    dct_dp_keep: float | None = None
    dct_mp_keep: float | None = None
    dct_refresh_every: int = 2000
    # FIITED (tfhybrid.fiited): per-row widths keeping this share of the tables' chunks;
    # None: dense tables
    fiited_target: float | None = None
    fiited_chunks: int = 8
    fiited_every: int = 1000                   # batches between adjustments
    fiited_ramp: int = 0                       # batches over which the budget shrinks
    # dynamic tables (tfhybrid.train.dynamic_tables): "all" or features by index or name,
    # fed raw keys; the options below default (None) to the layer's, capacity to the
    # feature's table rows
    dynamic_tables: Sequence[str] = ()
    dynamic_capacity: Sequence[int] = ()       # one for all, or one per dynamic table
    dynamic_admit_after: int | None = None     # sightings before a key gets a row (1)
    dynamic_evict: str | None = None           # "lfu" (default), "lru" or "none"
    dynamic_ttl_steps: int | None = None       # free rows unseen this many steps
    dynamic_stats_every: int | None = None     # record table_stats every N batches
    # synthetic_open: samples a drifting table's key lives (None: data.OPEN_KEY_LIFETIME)
    open_key_lifetime: int | None = None
    xla: bool = False
    # tfhybrid.TrainPipeline: the next batch's input and ids alltoall overlap this step
    # (same results); False runs the phases one after another, for debugging
    pipeline: bool = True
    batch_size: int = 1024                     # global
    steps: int | None = None                   # per epoch; None: one pass (file datasets)
    epochs: int = 1
    eval_batches: int | None = None            # None: the dataset's whole eval split
    embedding_dim: int = 16
    bottom_mlp_dims: Sequence[int] = (64, 16)
    top_mlp_dims: Sequence[int] = (64, 32, 1)
    num_cross_layers: int = 3
    projection_dim: int | None = None
    max_table_rows: int | None = 100_000
    cardinality_scale: float = 1e-3
    column_slice_threshold: int | None = None
    row_slice_threshold: int | None = None
    data_parallel_threshold: int | None = None
    # tables larger than this many bytes of DRAM per rank go to the disk tier
    # (tfhybrid.plan.place_in_tiers), their files in store_dir
    dram_budget: int | None = None
    store_dir: str | None = None
    skip_malformed: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0                  # steps; 0: only at the end
    restore: bool = False
    export_dir: str | None = None
    # the export's tables: "inline" (the SavedModel holds them) or "external" (also
    # written into the Redis Cluster at redis, for tfhybrid.serving.Predictor)
    export_tables: str = "inline"
    export_precision: str = "float32"
    redis: str | None = None                   # host:port,... of the cluster
    redis_password_file: str | None = None
    redis_username: str | None = None
    log_dir: str | None = None
    metrics_json: str | None = None
    warmup_steps: int = 5
    seed: int = 0
    threads: int | None = None                 # per rank; None: cores / local ranks
    # Horovod's stall limits in seconds; None: the environment's variable, else
    # tfhybrid's default (mesh.STALL_DEFAULTS). See stall_settings.
    stall_check_seconds: int | None = None
    stall_shutdown_seconds: int | None = None

    def validate(self) -> None:
        """Raises ValueError naming the first bad field and what it expects."""
        from tfhybrid.train.models import MODELS
        choices = {"model": MODELS, "dataset": data_lib.DATASETS, "layout": LAYOUTS,
                   "replica_sync": REPLICA_SYNC, "optimizer": OPTIMIZERS,
                   "mixed_precision": PRECISION_CHOICES, "communication": COMMUNICATION}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name}={getattr(self, name)!r} is unknown; expected one "
                                 f"of {', '.join(allowed)}")
        positive = ["sync_every", "batch_size", "epochs", "embedding_dim", "num_cross_layers",
                    "dct_refresh_every", "fiited_chunks", "fiited_every"]
        optional_positive = ["model_parallel", "eval_batches", "max_table_rows",
                             "projection_dim", "threads", "dram_budget"] + list(STALL_FLAGS)
        for name in positive + optional_positive:
            value = getattr(self, name)
            if value is None and name in optional_positive:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name}={value!r} must be an integer >= 1")
        # steps=0 evaluates (a restored checkpoint, say) without training
        for name in ("checkpoint_every", "warmup_steps", "fiited_ramp") + (
                ("steps",) if self.steps is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"--{name}={value!r} must be an integer >= 0")
        for name in ("embedding_optimizer", "dense_optimizer"):
            if getattr(self, name) is not None and getattr(self, name) not in OPTIMIZERS:
                raise ValueError(f"--{name}={getattr(self, name)!r} is unknown; expected one "
                                 f"of {', '.join(OPTIMIZERS)}")
        for name in ("embedding_learning_rate", "dense_learning_rate"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"--{name}={value!r} must be a finite number > 0")
        try:
            _dct(self)      # DCT's own checks, under the flags' names
        except ValueError as error:
            raise ValueError(f"--dct_{error}") from None
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"--learning_rate={self.learning_rate!r} must be a finite "
                             "number > 0")
        if not self.cardinality_scale > 0:
            raise ValueError(f"--cardinality_scale={self.cardinality_scale!r} must be > 0")
        if self.fiited_target is not None:
            _check_fiited(self)
        _check_export(self)
        if self.dram_budget is not None and not self.store_dir:
            raise ValueError(f"--dram_budget={self.dram_budget} may move tables to the disk "
                             "tier, which needs --store_dir (the folder of their files)")
        if (self.restore or self.checkpoint_every) and not self.checkpoint_dir:
            raise ValueError("--restore and --checkpoint_every need --checkpoint_dir")
        dynamic_tables.check(self)
        if self.model == "dlrm" and list(self.bottom_mlp_dims)[-1:] != [self.embedding_dim]:
            raise ValueError(f"--bottom_mlp_dims={list(self.bottom_mlp_dims)} must end in "
                             f"--embedding_dim={self.embedding_dim} for DLRM's dot "
                             "interaction")
        stall_settings(self)


def stall_settings(config: TrainConfig, environ=os.environ) -> dict[str, tuple[int, str]]:
    """The run's stall limits: {Horovod variable: (seconds, where the value comes from)}.

    A flag wins over the variable in ``environ`` (horovodrun's --stall-check-* options
    set those too), which wins over tfhybrid's default. Raises ValueError naming the
    values when they could not work: a shutdown limit below the check interval (Horovod
    then never shuts down), a variable that is not an integer, or a flag while
    HOROVOD_STALL_CHECK_DISABLE turns the check off.
    """
    settings = {}
    for field, name in STALL_FLAGS.items():
        flag = getattr(config, field)
        if flag is not None:
            settings[name] = (flag, f"--{field}={flag}")
        elif environ.get(name, "").strip():
            # 0 turns the shutdown off (Horovod's meaning); a check needs an interval
            least = 1 if name == mesh_lib.STALL_CHECK_ENV else 0
            try:
                seconds = int(environ[name])
            except ValueError:
                seconds = None
            if seconds is None or seconds < least:
                raise ValueError(f"{name}={environ[name]!r} must be an integer number of "
                                 f"seconds >= {least}")
            settings[name] = (seconds, f"{name}={environ[name]}")
        else:
            settings[name] = (mesh_lib.STALL_DEFAULTS[name], "tfhybrid's default "
                              f"{name}={mesh_lib.STALL_DEFAULTS[name]}")
    (check, check_from), (shutdown, shutdown_from) = (
        settings[mesh_lib.STALL_CHECK_ENV], settings[mesh_lib.STALL_SHUTDOWN_ENV])
    if 0 < shutdown < check:
        raise ValueError(f"{shutdown_from} is below {check_from}: Horovod ignores a stall "
                         "shutdown limit shorter than its check interval (it would never "
                         "shut down); lower --stall_check_seconds too")
    flags = [f"--{field}" for field in STALL_FLAGS if getattr(config, field) is not None]
    if flags and _stall_check_disabled(environ):
        raise ValueError(f"{' and '.join(flags)} cannot take effect: HOROVOD_STALL_CHECK_"
                         f"DISABLE={environ['HOROVOD_STALL_CHECK_DISABLE']} turns the stall "
                         "check off")
    return settings


def _stall_check_disabled(environ=os.environ) -> bool:
    # Horovod's own reading of the variable: strtol(value) > 0
    value = environ.get("HOROVOD_STALL_CHECK_DISABLE", "").strip()
    return value.lstrip("+-").isdigit() and int(value) > 0


def apply_stall_settings(config: TrainConfig) -> tuple[dict[str, int], list[str]]:
    """Puts the stall flags into the environment, where hvd.init reads them.

    Returns the limits in force ({variable: seconds}) and notes for rank 0 about flags
    that replaced a different value of the environment. Raises ValueError if Horovod
    already runs with other limits.
    """
    import horovod.tensorflow as hvd
    settings = stall_settings(config)
    notes = []
    for field, name in STALL_FLAGS.items():
        flag = getattr(config, field)
        if flag is None:
            continue
        current = os.environ.get(name)
        if hvd.is_initialized():
            # hvd.init read the variable once; a different value now would be ignored
            if current != str(flag):
                raise ValueError(f"--{field}={flag} cannot take effect: Horovod is already "
                                 f"initialised in this process with {name}={current}")
            continue
        if current is not None and current != str(flag):
            notes.append(f"--{field}={flag} replaces {name}={current} from the environment")
        os.environ[name] = str(flag)
    return {name: seconds for name, (seconds, _) in settings.items()}, notes


def _configure_threads(config: TrainConfig) -> None:
    import tensorflow as tf
    local_ranks = int(os.environ.get("HOROVOD_LOCAL_SIZE", os.environ.get(
        "OMPI_COMM_WORLD_LOCAL_SIZE", "1")))
    # ranks on one node share its cores; more threads than cores only thrash
    threads = config.threads or max(1, (os.cpu_count() or 1) // max(1, local_ranks))
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        # the pipeline's read-ahead runs beside the step: with one inter-op thread the two
        # functions would take turns (two 50 ms functions: 97 ms on one, 55 ms on two)
        tf.config.threading.set_inter_op_parallelism_threads(
            max(threads, 2) if config.pipeline else threads)
    except RuntimeError:
        pass  # the runtime already started (run() called twice in one process): keep it


def distributed_optimizer(config: TrainConfig) -> Any:
    """The distributed optimizer: one for everything, or one for the dense layers and
    another for the tables (``--dense_optimizer`` / ``--embedding_optimizer``)."""
    import tfhybrid
    dense = _make_optimizer(config.dense_optimizer or config.optimizer,
                            config.dense_learning_rate or config.learning_rate)
    tables = None
    if config.embedding_optimizer is not None:
        tables = _make_optimizer(config.embedding_optimizer,
                                 config.embedding_learning_rate or config.learning_rate)
    import horovod.tensorflow as hvd
    compression = (hvd.Compression.fp16 if config.communication == "float16"
                   else hvd.Compression.none)
    return tfhybrid.DistributedOptimizer(dense, embedding_optimizer=tables,
                                         compression=compression, dct=_dct(config))


def _check_fiited(config: TrainConfig) -> None:
    """What --fiited_target needs, as ValueErrors naming the flags."""
    target = config.fiited_target
    if isinstance(target, bool) or not (isinstance(target, (int, float))
                                        and math.isfinite(target) and 0 < target <= 1):
        raise ValueError(f"--fiited_target={target!r} must be a number in (0, 1] (the "
                         "share of the tables' chunks kept)")
    if config.embedding_dim % config.fiited_chunks:
        raise ValueError(f"--fiited_chunks={config.fiited_chunks} must divide "
                         f"--embedding_dim={config.embedding_dim}")
    tables = config.embedding_optimizer or config.optimizer
    if tables not in ("rowwise_adagrad", "ms_rowwise_adagrad"):
        raise ValueError(f"--fiited_target needs the tables trained by row-wise AdaGrad "
                         f"(--optimizer or --embedding_optimizer rowwise_adagrad or "
                         f"ms_rowwise_adagrad), whose state follows a resized row; got "
                         f"{tables!r}")
    if config.replica_sync != "gradients":
        raise ValueError(f"--fiited_target needs --replica_sync=gradients; got "
                         f"{config.replica_sync!r}")


def _fiited(config: TrainConfig) -> dict | None:
    """The tables' FIITED options of the flags (a model's ``fiited``), or None."""
    if config.fiited_target is None:
        return None
    return {"chunks": config.fiited_chunks, "target_memory": float(config.fiited_target)}


def _fiited_figures(model) -> dict | None:
    """The run's FIITED figures: chunks kept and embedding bytes (the tables' pools and
    row offsets, one replica) against dense tables. Every rank must call it. A table the
    planner put in the disk tier keeps the same widths but holds a cache of full-width
    rows instead of its pool: the metrics' ``embedding_memory`` is what a rank holds."""
    tables = model.embedding.embedding_layers
    counts = model.embedding.chunks_per_row()
    kept = sum(int(c.sum()) for c in counts if c is not None)
    pool = index = dense = 0
    for layer, c in zip(tables, counts):
        if c is None:
            continue
        chunk_bytes = 4 * layer.output_dim // layer.chunks
        pool += int(c.sum()) * chunk_bytes
        index += 4 * (layer.input_dim + 1)
        dense += 4 * layer.input_dim * layer.output_dim
    return {"chunks_kept": kept, "embedding_bytes": pool + index, "dense_bytes": dense,
            "memory_saved": 1.0 - (pool + index) / dense if dense else 0.0}


def _dct(config: TrainConfig):
    """The DCT settings of the flags, or None when both halves are off."""
    if config.dct_dp_keep is None and config.dct_mp_keep is None:
        return None
    from tfhybrid.compression import DCT
    return DCT(dp_keep=config.dct_dp_keep, mp_keep=config.dct_mp_keep,
               refresh_every=config.dct_refresh_every)


def _dct_config(config: TrainConfig) -> dict | None:
    """``_dct`` as plain data (a model's config, the metrics JSON)."""
    dct = _dct(config)
    return None if dct is None else dct.get_config()


def _make_optimizer(name: str, lr: float):
    import tensorflow as tf
    from tfhybrid import _tf_internals
    from tfhybrid import optimizers
    if name == "sgd":
        # SGD that scatters sparse gradients into the rows they touch, with no slot: a
        # dense update would pass over every table per step
        return _tf_internals.scattering_sgd(lr)
    # an XLA-compiled update copies the whole table around its scatter
    if name == "adagrad":
        return tf.keras.optimizers.Adagrad(lr, **_tf_internals.without_xla_update())
    if name == "adam":
        return tf.keras.optimizers.Adam(lr, **_tf_internals.without_xla_update())
    if name == "rowwise_adagrad":
        return optimizers.RowWiseAdagrad(lr)
    return optimizers.MomentumScaledRowWiseAdagrad(lr)


def _network_bytes() -> tuple[int, int] | None:
    """(sent, received) bytes of this host's network interfaces, loopback aside; None
    where /proc/net/dev is not there. On a cluster that is the node's NIC traffic."""
    try:
        with open("/proc/net/dev") as f:
            lines = f.readlines()[2:]
    except OSError:
        return None
    sent = received = 0
    for line in lines:
        name, counters = line.split(":", 1)
        if name.strip() == "lo":
            continue
        fields = counters.split()
        received += int(fields[0])
        sent += int(fields[8])
    return sent, received


class _Throughput:
    """Samples per second, step times and this host's network bytes, over the steps after
    the warm-up (compilation, first touches)."""

    def __init__(self, global_batch: int, warmup: int):
        import tensorflow as tf

        outer = self

        class Callback(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
                now = time.perf_counter()
                outer.steps += 1
                if outer.steps > warmup and outer.last is not None:
                    outer.step_seconds.append(now - outer.last)
                outer.last = now
                if outer.steps == warmup:
                    outer.start = now
                    outer.network_start = _network_bytes()

            def on_train_end(self, logs: dict | None = None) -> None:
                outer.end = time.perf_counter()
                outer.network_end = _network_bytes()

        self.callback = Callback()
        self.global_batch = global_batch
        self.steps = 0
        self.warmup = warmup
        self.step_seconds: list[float] = []
        self.start = self.end = self.last = None
        self.network_start = self.network_end = None
        if warmup == 0:
            self.start = self.last = time.perf_counter()
            self.network_start = _network_bytes()

    def samples_per_second(self) -> float | None:
        timed = self.steps - self.warmup
        if self.start is None or self.end is None or timed <= 0:
            return None
        return timed * self.global_batch / (self.end - self.start)

    def figures(self) -> dict:
        """Step-time quartiles and network bytes per timed step, for the results."""
        import numpy as np
        out: dict = {}
        if self.step_seconds:
            q25, q50, q75 = np.percentile(self.step_seconds, [25, 50, 75])
            out.update(step_seconds_median=float(q50), step_seconds_p25=float(q25),
                       step_seconds_p75=float(q75), timed_steps=len(self.step_seconds))
        timed = self.steps - self.warmup
        if self.network_start and self.network_end and timed > 0:
            out["host_network_bytes_per_step"] = {
                "sent": (self.network_end[0] - self.network_start[0]) / timed,
                "received": (self.network_end[1] - self.network_start[1]) / timed}
        return out


def _sync_replicas(model, optimizer, mesh) -> None:
    """Averages weight-sync replicas (a no-op in gradient-sync mode), so that what is
    evaluated or saved is the same on every replica."""
    import tfhybrid
    tfhybrid.sync_replicas(model, optimizer, mesh)


def _checkpoint_callback(config: TrainConfig, model, optimizer, mesh, first_step: int):
    import tensorflow as tf
    from tfhybrid.train import checkpoint

    class Checkpoints(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = first_step

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.step += 1
            if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                _sync_replicas(model, optimizer, mesh)
                checkpoint.save(config.checkpoint_dir, model, optimizer, self.step, mesh)

    return Checkpoints()


def _input_check_callback(steps: int, rank: int):
    import tensorflow as tf

    class InputRanOut(tf.keras.callbacks.Callback):
        """Raises when this rank's training input ended before the epoch's last step.

        Keras only warns and ends the epoch on this rank; the other ranks would wait for
        it in their next step's collectives until the stall shutdown. Raising names the
        cause at once (and horovodrun then stops every rank).
        """

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self.batches = 0

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.batches += 1

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            if self.batches < steps:
                raise RuntimeError(
                    f"rank {rank}: the training input ran out after {self.batches} of "
                    f"{steps} steps of epoch {epoch + 1}; every rank must run the same "
                    "steps, the others are waiting for this rank in a collective")

    return InputRanOut()


def _extensions() -> list:
    """The modules ``EXTENSIONS_ENV`` names, imported."""
    names = [n.strip() for n in os.environ.get(EXTENSIONS_ENV, "").split(",") if n.strip()]
    return [importlib.import_module(name) for name in names]


class _StallWatchdog:
    """Ends a training run whose ranks stopped meeting in collectives, after the stall limits.

    Horovod's own stall shutdown never fires under horovodrun --gloo: Horovod 0.28.1's
    Gloo controller fills its rank list after ``reserve()`` instead of ``resize()``, so
    its stall inspector loops over zero ranks and finds no one missing. This thread
    applies HOROVOD_STALL_CHECK_TIME_SECONDS / HOROVOD_STALL_SHUTDOWN_TIME_SECONDS to the
    training steps instead: every check interval it looks at how long ago this rank
    finished its last step (its callbacks, checkpoint saves among them, included); past
    the check interval it warns, past the shutdown limit it shuts Horovod down, which
    fails the pending collectives of every rank, so every rank raises. A rank stuck
    outside Horovod (in Python or I/O) never sees that error: it exits with status 1
    one check interval later. The first step of a fit is not timed: it traces the
    train function, which takes long on a big model without any rank stalling.
    """

    def __init__(self, stall: dict[str, int], rank: int, first_step: int):
        import tensorflow as tf

        self.check = stall[mesh_lib.STALL_CHECK_ENV]
        self.shutdown = stall[mesh_lib.STALL_SHUTDOWN_ENV]
        self.rank = rank
        self.step = first_step
        self.last_step_end: float | None = None   # monotonic time; None: not armed
        self.left = threading.Event()              # fit returned or raised
        outer = self

        class Callback(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
                outer.step += 1
                outer.last_step_end = time.monotonic()

        self.callback = Callback()

    def __enter__(self) -> "_StallWatchdog":
        threading.Thread(target=self._watch, name="tfhybrid-stall-watchdog",
                         daemon=True).start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.left.set()

    def _say(self, text: str) -> None:
        print(f"tfhybrid.train: rank {self.rank}: {text}", file=sys.stderr, flush=True)

    def _watch(self) -> None:
        import horovod.tensorflow as hvd
        while not self.left.wait(self.check):
            if self.last_step_end is None:
                continue
            idle = time.monotonic() - self.last_step_end
            waiting = (f"no training step has finished for {idle:.0f} s, since step "
                       f"{self.step}")
            if idle <= self.shutdown:
                if idle > self.check:
                    self._say(f"{waiting}; a rank may have stopped calling collectives (the "
                              f"stall shutdown comes after {self.shutdown} s)")
                continue
            self._say(f"{waiting}, beyond the stall shutdown limit of {self.shutdown} s: "
                      "a rank stopped calling collectives (an exception, a hang, input that "
                      "ran out) and the others wait for it; shutting Horovod down")
            # hvd.shutdown agrees with the other ranks' background threads; it must not
            # keep this thread from the exit below if they are gone
            threading.Thread(target=hvd.shutdown, daemon=True).start()
            if not self.left.wait(self.check):
                self._say("still stuck outside Horovod's collectives; exiting")
                os._exit(1)
            return


@contextlib.contextmanager
def _explain_shutdown(rank: int, stall: dict[str, int]):
    """Adds the likely causes to the bare error of a collective that Horovod shut down."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised, with context if Horovod's
        if _HOROVOD_SHUT_DOWN not in str(error):
            raise
        raise RuntimeError(
            f"rank {rank}: Horovod shut down while this rank waited in a collective: "
            "another rank raised (its error is in the log), or the training steps stalled "
            "longer than the stall shutdown limit of "
            f"{stall[mesh_lib.STALL_SHUTDOWN_ENV]} s (the log says which rank and since "
            "which step)") from error


def _count_batches(dataset) -> int:
    import tensorflow as tf
    count = int(dataset.cardinality())
    if count >= 0:
        return count
    return int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))


def _choose_precision(config: TrainConfig, mesh: mesh_lib.Mesh) -> tuple[str, str | None]:
    """(--mixed_precision to run, a note or None): rank 0 times a GEMM of the towers'
    widest layer at the local batch in float32 and 16 bits, and every rank takes its
    figures, so all ranks choose alike (their collectives carry the compute dtype)."""
    from tfhybrid.train import precision
    if config.mixed_precision == "none":
        return "none", None
    import horovod.tensorflow as hvd
    widest = max([*config.bottom_mlp_dims, *config.top_mlp_dims])
    dtype = precision.HALF_DTYPES.get(config.mixed_precision, "bfloat16")
    speed = (precision.measure_gemm(dtype, config.batch_size // mesh.size, widest, widest)
             if mesh.rank == 0 else None)
    if mesh.size > 1:
        speed = hvd.broadcast_object(speed, root_rank=0, name="tfhybrid_train_precision")
    return precision.choose(config.mixed_precision, speed)


def evaluate(model, dataset, mesh) -> dict:
    """AUC and log loss over every rank's share of ``dataset``, computed exactly.

    Every rank calls it; each returns the same figures.
    """
    import numpy as np
    import tensorflow as tf
    from tfhybrid import collectives
    from tfhybrid.train import metrics

    predict = tf.function(lambda features: model(features, training=False), autograph=False)
    logits, labels = [], []
    for features, batch_labels in dataset:
        logits.append(predict(features).numpy().reshape(-1))
        labels.append(batch_labels.numpy().reshape(-1))
    local = np.stack([np.concatenate(logits), np.concatenate(labels)]).T.astype(np.float64)
    everyone = collectives.allgather(tf.constant(local), mesh.size, "tfhybrid_eval").numpy()
    probabilities = 1.0 / (1.0 + np.exp(-everyone[:, 0]))
    return {"auc": metrics.roc_auc(everyone[:, 1], probabilities),
            "logloss": metrics.log_loss(everyone[:, 1], probabilities),
            "eval_samples": int(everyone.shape[0])}


def run(config: TrainConfig) -> dict:
    """Trains and evaluates as ``config`` says; returns (on every rank) the final figures."""
    config.validate()
    _configure_threads(config)
    import tensorflow as tf

    import tfhybrid
    from tfhybrid import _tf_internals
    from tfhybrid import callbacks
    from tfhybrid import roles
    from tfhybrid.train.models import build_model, example_batch, export_for_serving

    stall, stall_notes = apply_stall_settings(config)
    mesh = tfhybrid.init(model_parallel=config.model_parallel, layout=config.layout)
    mixed_precision, precision_note = _choose_precision(config, mesh)
    tf.keras.mixed_precision.set_global_policy(MIXED_PRECISION[mixed_precision])
    data_options = dict(data_dir=config.data_dir, max_table_rows=config.max_table_rows,
                        cardinality_scale=config.cardinality_scale, seed=config.seed)
    spec = data_lib.dataset_spec(config.dataset, **data_options)
    dynamic = dynamic_tables.table_options(config, spec.table_rows)
    open_key_lifetime = config.open_key_lifetime or data_lib.OPEN_KEY_LIFETIME
    # the dynamic tables' columns come as raw keys, the others as row ids
    shard = dict(global_batch_size=config.batch_size, rank=mesh.rank, size=mesh.size,
                 skip_malformed=config.skip_malformed, raw_keys=tuple(dynamic),
                 open_key_lifetime=open_key_lifetime, **data_options)

    model_options = dict(
        embedding_dim=config.embedding_dim, top_mlp_dims=list(config.top_mlp_dims),
        xla=config.xla, seed=config.seed, embedding_options=dict(
            column_slice_threshold=config.column_slice_threshold,
            row_slice_threshold=config.row_slice_threshold,
            data_parallel_threshold=config.data_parallel_threshold,
            replica_sync=config.replica_sync, sync_every=config.sync_every,
            optimizer=config.embedding_optimizer or config.optimizer,
            dct=_dct_config(config),
            **({} if config.dram_budget is None else dict(
                memory_budget={"dram": config.dram_budget}, store_dir=config.store_dir))),
        fiited=_fiited(config), dynamic_tables=dynamic)
    if config.communication == "float16" and mixed_precision == "none":
        # the wire carries the layer's compute dtype; the towers stay float32
        model_options["embedding_options"]["dtype"] = "mixed_float16"
    if config.model == "dlrm":
        model_options["bottom_mlp_dims"] = list(config.bottom_mlp_dims)
    else:
        model_options.update(num_cross_layers=config.num_cross_layers,
                             projection_dim=config.projection_dim)
    model = build_model(config.model, spec.table_rows, spec.dense_features, **model_options)
    local_batch = config.batch_size // mesh.size
    # a dynamic table admits the keys of a training call: the zeros that build the
    # model must not become key 0's row
    model(example_batch(model, local_batch), **(dict(training=False) if dynamic else {}))
    optimizer = distributed_optimizer(config)
    # jit_compile stays off: the collectives cannot be compiled (xla=True compiles towers)
    model.compile(optimizer=optimizer,
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
                  jit_compile=False)

    if config.checkpoint_dir:
        from tfhybrid.train import checkpoint
    first_step = 0
    if config.restore:
        if checkpoint.latest(config.checkpoint_dir) is None:
            raise FileNotFoundError(f"--restore: no checkpoint in --checkpoint_dir="
                                    f"{config.checkpoint_dir!r}")
        first_step = checkpoint.restore(config.checkpoint_dir, model, optimizer, mesh)

    train = data_lib.make_dataset(config.dataset, "train", **shard)
    parse_stats = data_lib.parse_stats(train)
    if config.steps is None:
        if int(train.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
            raise ValueError(f"--dataset={config.dataset!r} is endless; give --steps")
        steps = _count_batches(train)
        # one whole pass: its count is the file's, however many epochs re-read it
        malformed = parse_stats.malformed if parse_stats else 0
        if steps == 0:
            raise ValueError(f"--dataset={config.dataset!r} has fewer training samples than "
                             f"one global batch of --batch_size={config.batch_size}")
    else:
        steps = config.steps
        malformed = None
    # a restored run continues with the batches it has not seen
    train = train.repeat().skip(first_step)
    extensions = _extensions()
    for extension in extensions:
        if hasattr(extension, "train_input"):
            train = extension.train_input(train, mesh.rank)
    train = train.prefetch(2)

    throughput = _Throughput(config.batch_size, min(config.warmup_steps,
                                                     max(0, steps * config.epochs - 1)))
    # one process has no other rank to wait for
    watchdog = (_StallWatchdog(stall, mesh.rank, first_step) if mesh.size > 1
                and stall[mesh_lib.STALL_SHUTDOWN_ENV] > 0 and not _stall_check_disabled()
                else None)
    # first: they must act before the defaults' collectives at the same hook
    fit_callbacks = [_input_check_callback(steps, mesh.rank)]
    if watchdog:
        fit_callbacks.insert(0, watchdog.callback)
    for extension in extensions:
        if hasattr(extension, "train_callbacks"):
            fit_callbacks += extension.train_callbacks(mesh.rank, first_step)
    fit_callbacks += callbacks.defaults(mesh) + [throughput.callback]
    if config.fiited_target is not None:
        fit_callbacks.append(callbacks.FiitedAdjust(config.fiited_every, config.fiited_ramp))
    table_history = None
    if config.dynamic_stats_every:
        table_history = callbacks.DynamicTableStats(config.dynamic_stats_every)
        fit_callbacks.append(table_history)
    if config.checkpoint_dir:
        fit_callbacks.append(_checkpoint_callback(config, model, optimizer, mesh, first_step))
    if config.log_dir and mesh.rank == 0:
        fit_callbacks.append(tf.keras.callbacks.TensorBoard(config.log_dir, update_freq=50))
    if mesh.rank == 0:
        print(f"tfhybrid.train: {config.model} on {config.dataset}, mesh {mesh.shape[0]}x"
              f"{mesh.shape[1]} (D={mesh.data_parallel} replicas x M={mesh.model_parallel} "
              f"model-parallel ranks), global batch {config.batch_size}, "
              f"{steps} steps x {config.epochs} epochs, {mixed_precision}, Keras "
              f"{_tf_internals.KERAS_MAJOR}"
              f"{', XLA towers' if config.xla else ''}"
              f"{f', {len(dynamic)} dynamic tables' if dynamic else ''}"
              f"{', pipelined' if config.pipeline else ''}", flush=True)
        if mesh.size > 1:
            print(f"stall check every {stall[mesh_lib.STALL_CHECK_ENV]} s, shutdown "
                  + (f"after {stall[mesh_lib.STALL_SHUTDOWN_ENV]} s" if watchdog else "off")
                  + "".join(f"; {note}" for note in stall_notes), flush=True)
        if precision_note:
            print(f"tfhybrid.train: {precision_note}", file=sys.stderr, flush=True)
        print(model.embedding.plan.describe() if hasattr(model.embedding, "plan")
              and model.embedding.plan is not None else "", flush=True)
    traffic = None
    if config.count_traffic:
        from tfhybrid import collectives
        traffic = collectives.count_traffic()
    train_loss = None
    if config.pipeline:
        tfhybrid.TrainPipeline(model)   # model.fit reads a batch ahead
    if steps > 0:
        with _explain_shutdown(mesh.rank, stall), watchdog or contextlib.nullcontext():
            # the dataset holds its own order; Keras 3 warns at fit's default shuffle=True
            history = model.fit(train, epochs=config.epochs, steps_per_epoch=steps,
                                shuffle=False, callbacks=fit_callbacks,
                                verbose=callbacks.verbose(1, mesh))
        train_loss = float(history.history["loss"][-1])
    _sync_replicas(model, optimizer, mesh)
    last_step = first_step + steps * config.epochs

    # synthetic_open's eval is the traffic that follows the samples trained on
    eval_start = last_step * config.batch_size
    eval_data = data_lib.make_dataset(config.dataset, "eval", num_batches=config.eval_batches,
                                      eval_start=eval_start, **shard)
    with _explain_shutdown(mesh.rank, stall):
        results = evaluate(model, eval_data, mesh)
    best_auc = (spec.best_auc if config.dataset != "synthetic_open" else data_lib.best_auc(
        config.dataset, eval_start=eval_start, open_key_lifetime=open_key_lifetime,
        max_table_rows=config.max_table_rows, cardinality_scale=config.cardinality_scale,
        seed=config.seed))
    results.update(
        model=config.model, dataset=config.dataset, mesh=list(mesh.shape), layout=mesh.layout,
        keras=_tf_internals.KERAS_MAJOR,
        steps=last_step,
        global_batch=config.batch_size,
        train_loss=train_loss,
        communication=config.communication,
        pipeline=config.pipeline,
        mixed_precision=mixed_precision,
        dct=_dct_config(config),
        fiited=None if config.fiited_target is None else dict(
            _fiited(config), every=config.fiited_every, ramp=config.fiited_ramp,
            **_fiited_figures(model)),
        samples_per_second=throughput.samples_per_second(), best_auc=best_auc,
        **throughput.figures(),
        malformed_lines_skipped=malformed if malformed is not None else (
            parse_stats.malformed if parse_stats else 0))
    plan = getattr(model.embedding, "plan", None)
    if plan is not None:
        # what the run executed, for tfhybrid.plan (plain data, JSON)
        results["plan"] = json.loads(plan.to_json())
        results["table_rows"] = list(spec.table_rows)
        results["dense_parameters"] = int(sum(
            v.shape.num_elements() for v in model.trainable_variables
            if not roles.is_embedding(v)))
        # this rank's tables in DRAM and on disk, and its tiered shards' cache hits
        results["embedding_memory"] = model.embedding.memory_bytes()
        # the disk tier's caches only: a dynamic table counts its keys' hits, reported
        # below
        counted = [stats for stats in (store.stats() for (t, _), store in
                                       model.embedding.stores.items() if t not in dynamic)
                   if "hits" in stats]
        if counted:
            hits = sum(stats["hits"] for stats in counted)
            looked = hits + sum(stats["misses"] for stats in counted)
            results["tier_hit_rate"] = hits / looked if looked else 0.0
    if dynamic:
        # a collective: every rank takes part; counters summed over each model group
        stats = model.embedding.table_stats()
        # by feature name (the model names feature t's table "table_t")
        stats = {spec.feature_names[t]: stats[f"table_{t}"] for t in dynamic}
        results["dynamic_tables"] = dict(
            features=[spec.feature_names[t] for t in dynamic],
            options={spec.feature_names[t]: options for t, options in dynamic.items()},
            totals=dynamic_tables.totals(stats), tables=stats,
            history=None if table_history is None else [
                dict(batch=batch, **dynamic_tables.totals(seen))
                for batch, seen in table_history.history])
        if config.dataset == "synthetic_open":
            results["open_key_lifetime"] = open_key_lifetime
    if traffic is not None and steps > 0:
        # this rank's collectives over every training step (warm-up included)
        results["collective_bytes_per_step"] = {
            kind: int(v.numpy()) / (steps * config.epochs) for kind, v in traffic.items()}
    if config.checkpoint_dir:
        results["checkpoint"] = checkpoint.save(config.checkpoint_dir, model, optimizer,
                                                last_step, mesh)
    if config.export_dir:
        export_for_serving(model, config.export_dir, mesh.rank,
                           store=_serving_store(config), tables=config.export_tables,
                           precision=config.export_precision)
        results["export_dir"] = config.export_dir
    if mesh.rank == 0:
        _report(results, config)
    # Horovod shuts the job down when the first rank exits; a rank that finished early
    # would break the collectives (export's gathers) that others are still running.
    from tfhybrid import collectives
    collectives.allgather(tf.zeros([1]), mesh.size, "tfhybrid_train_done")
    return results


def _check_export(config: TrainConfig) -> None:
    """The serving flags: ValueError naming the first bad one."""
    if config.export_tables not in EXPORT_TABLES:
        raise ValueError(f"--export_tables={config.export_tables!r} is unknown; expected "
                         f"one of {', '.join(EXPORT_TABLES)}")
    if config.export_precision not in EXPORT_PRECISIONS:
        raise ValueError(f"--export_precision={config.export_precision!r} is unknown; "
                         f"expected one of {', '.join(EXPORT_PRECISIONS)}")
    if config.export_tables == "external" and not (config.export_dir and config.redis):
        raise ValueError("--export_tables=external needs --export_dir and --redis "
                         "(host:port,... of the Redis Cluster)")
    if config.redis_password_file and not os.path.isfile(config.redis_password_file):
        raise ValueError(f"--redis_password_file={config.redis_password_file!r} is not a "
                         "file")


def _serving_store(config: TrainConfig) -> Any:
    """The Redis Cluster of --redis, or None when the export keeps its tables inline."""
    if config.export_tables != "external":
        return None
    password = None
    if config.redis_password_file:
        with open(config.redis_password_file) as f:
            password = f.read().strip()
    return RedisStore(config.redis, username=config.redis_username, password=password,
                      key_prefix=os.path.basename(os.path.normpath(config.export_dir)))


def _report(results: dict, config: TrainConfig) -> None:
    rate = results["samples_per_second"]
    best = results["best_auc"]
    loss = results["train_loss"]
    print(f"steps {results['steps']}, global batch {results['global_batch']}, train loss "
          f"{'n/a' if loss is None else f'{loss:.4f}'}, throughput "
          f"{'n/a' if rate is None else f'{rate:,.0f} samples/s'}")
    print(f"eval: AUC {results['auc']:.4f}, logloss {results['logloss']:.4f} over "
          f"{results['eval_samples']:,} samples"
          f"{'' if best is None else f' (the planted teacher reaches AUC {best:.4f})'}")
    if "dynamic_tables" in results:
        for line in dynamic_tables.describe(results["dynamic_tables"]["tables"]):
            print(line)
    if results["malformed_lines_skipped"]:
        print(f"skipped {results['malformed_lines_skipped']:,} malformed lines "
              "(--skip_malformed)")
    if config.log_dir:
        import tensorflow as tf
        with tf.summary.create_file_writer(os.path.join(config.log_dir, "eval")).as_default():
            tf.summary.scalar("auc", results["auc"], step=results["steps"])
            tf.summary.scalar("logloss", results["logloss"], step=results["steps"])
    if config.metrics_json:
        tmp = config.metrics_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, config.metrics_json)


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """A ``TrainConfig`` from a dict, naming any unknown key."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown TrainConfig fields {unknown}; expected some of "
                         f"{sorted(known)}")
    return TrainConfig(**values)
