"""``python -m tfhybrid.train``: train DLRM or DCN-v2 in one process or under horovodrun.

Examples::

    python -m tfhybrid.train --model=dlrm --dataset=synthetic --steps=200
    horovodrun -np 4 -H localhost:4 --gloo python -m tfhybrid.train \\
        --model=dlrm --dataset=synthetic --model_parallel=2
    python -m tfhybrid.train --model=dcnv2 --dataset=criteo_tsv --data_dir=/data/criteo
    python -m tfhybrid.train --dataset=movielens --epochs=5 --optimizer=rowwise_adagrad

Every flag is a field of ``tfhybrid.train.app.TrainConfig``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app, flags


# TensorFlow's own rule: these values make tf.keras Keras 2 (tf-keras), any other Keras 3
_LEGACY_VALUES = ("true", "True", "1")
KERAS_CHOICES = ("2", "3")
# the user's own TF_USE_LEGACY_KERAS (None: unset), read before --keras may fill it in
USER_LEGACY_KERAS = os.environ.get("TF_USE_LEGACY_KERAS")


def _keras_in_argv(argv: list[str]) -> str | None:
    """The value of ``--keras`` on the command line (``--keras=3`` or ``--keras 3``),
    read before absl parses it: the choice must be made before tf.keras is first used,
    which the imports below do."""
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--":
            break
        if arg.startswith("--keras="):
            return arg.split("=", 1)[1]
        if arg == "--keras" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def keras_conflict(keras: str | None, user_setting: str | None) -> str | None:
    """Why ``--keras=keras`` cannot be honoured when the user set ``TF_USE_LEGACY_KERAS``
    to ``user_setting`` (None: unset), or None when it can."""
    if keras not in KERAS_CHOICES or user_setting is None:
        return None
    wanted = "2" if user_setting in _LEGACY_VALUES else "3"
    if wanted == keras:
        return None
    return (f"--keras={keras} asks for Keras {keras}, but TF_USE_LEGACY_KERAS="
            f"{user_setting!r} asks for Keras {wanted}; drop one of them or make them agree")


def choose_keras(argv: list[str], environ: dict) -> None:
    """Sets ``TF_USE_LEGACY_KERAS`` for ``--keras`` where the user did not set it
    (TensorFlow's default stays otherwise). A conflicting setting is left alone; ``main``
    refuses it."""
    keras = _keras_in_argv(argv)
    if keras in KERAS_CHOICES and USER_LEGACY_KERAS is None:
        environ["TF_USE_LEGACY_KERAS"] = "1" if keras == "2" else "0"


choose_keras(sys.argv, os.environ)

# pylint: disable=wrong-import-position: these import TensorFlow, after the Keras choice
from tfhybrid import _tf_internals  # noqa: E402
from tfhybrid import mesh as mesh_lib  # noqa: E402
from tfhybrid.train import app as train_app  # noqa: E402
from tfhybrid.train import data as data_lib  # noqa: E402
from tfhybrid.train import dynamic_tables  # noqa: E402
from tfhybrid.train.models import MODELS  # noqa: E402

_DEFAULTS = train_app.TrainConfig()

flags.DEFINE_enum("keras", None, list(KERAS_CHOICES),
                  "The Keras that tf.keras is: 2 (tf-keras) or 3. Sets TF_USE_LEGACY_KERAS "
                  "(1 or 0) when it is unset; a different setting there is refused. Default: "
                  "TF_USE_LEGACY_KERAS, else TensorFlow's default (Keras 3 from TF 2.16).")
flags.DEFINE_enum("model", _DEFAULTS.model, list(MODELS), "Model to train.")
flags.DEFINE_enum("dataset", _DEFAULTS.dataset, list(data_lib.DATASETS), "Input data.")
flags.DEFINE_string("data_dir", None, "Folder of the dataset's files (criteo_tsv: see "
                    "tfhybrid/train/data.py; movielens: fetched there on first use).")
flags.DEFINE_integer("model_parallel", None, "M, ranks per model group; default all ranks.")
flags.DEFINE_enum("layout", _DEFAULTS.layout, list(train_app.LAYOUTS), "Rank layout.")
flags.DEFINE_enum("replica_sync", _DEFAULTS.replica_sync, list(train_app.REPLICA_SYNC),
                  "Keep shard replicas in step by gradients (exact) or weights every K steps.")
flags.DEFINE_integer("sync_every", _DEFAULTS.sync_every, "K for --replica_sync=weights.")
flags.DEFINE_enum("optimizer", _DEFAULTS.optimizer, list(train_app.OPTIMIZERS), "Optimizer.")
flags.DEFINE_float("learning_rate", _DEFAULTS.learning_rate, "Learning rate.")
flags.DEFINE_enum("embedding_optimizer", None, list(train_app.OPTIMIZERS),
                  "Optimizer of the embedding tables (default: --optimizer).")
flags.DEFINE_float("embedding_learning_rate", None, "Tables' learning rate (default: "
                   "--learning_rate).")
flags.DEFINE_enum("dense_optimizer", None, list(train_app.OPTIMIZERS),
                  "Optimizer of the dense layers (default: --optimizer).")
flags.DEFINE_float("dense_learning_rate", None, "Dense layers' learning rate (default: "
                   "--learning_rate).")
flags.DEFINE_enum("mixed_precision", _DEFAULTS.mixed_precision,
                  list(train_app.PRECISION_CHOICES),
                  "Compute precision. fp16/bf16 time a 16-bit GEMM first and warn when it is "
                  "slower than float32 here (CPUs without AMX); auto takes bf16 only where "
                  "its GEMMs are faster.")
flags.DEFINE_enum("communication", _DEFAULTS.communication, list(train_app.COMMUNICATION),
                  "What the collectives carry: float16 halves the lookups' alltoall and the "
                  "gradient allreduces while the model computes in float32 (no loss scaling).")
flags.DEFINE_bool("count_traffic", _DEFAULTS.count_traffic,
                  "Report the bytes each rank's alltoalls and allreduces send per step.")
flags.DEFINE_float("dct_dp_keep", None, "DCT-DP: the share of each data-parallel gradient a "
                   "rank sends per step (its largest entries; the rest waits in a residual). "
                   "Default: off.")
flags.DEFINE_float("dct_mp_keep", None, "DCT-MP: the share of each sample's looked-up rows "
                   "the alltoall returns (its largest entries). Default: off.")
flags.DEFINE_integer("dct_refresh_every", _DEFAULTS.dct_refresh_every,
                     "DCT-DP: steps between recomputations of each gradient's threshold.")
flags.DEFINE_float("fiited_target", None, "FIITED: per-row embedding widths learned in "
                   "training, keeping this share of the tables' chunks (e.g. 0.35). Needs "
                   "row-wise AdaGrad for the tables. Default: off (dense tables).")
flags.DEFINE_integer("fiited_chunks", _DEFAULTS.fiited_chunks,
                     "FIITED: chunks per row (must divide --embedding_dim).")
flags.DEFINE_integer("fiited_every", _DEFAULTS.fiited_every,
                     "FIITED: training batches between adjustments of the widths.")
flags.DEFINE_integer("fiited_ramp", _DEFAULTS.fiited_ramp,
                     "FIITED: batches over which the budget goes from the whole tables to "
                     "--fiited_target (0: at once).")
flags.DEFINE_list("dynamic_tables", [], "Dynamic tables (tfhybrid.layers.DynamicEmbedding) "
                  "for these categorical features: 'all', or 0-based indices and feature "
                  "names (C1,C10; user_id). Their columns are fed raw int64 keys (synthetic: "
                  "the ids; synthetic_open: its keys; criteo_tsv: the hex value, empty -1; "
                  "movielens: the ids, uncapped) and the tables admit and evict keys. Needs "
                  "the tables trained by rowwise_adagrad, ms_rowwise_adagrad or sgd.")
flags.DEFINE_list("dynamic_capacity", [], "Rows of each dynamic table (over its model "
                  "group): one number for all, or one per dynamic table in feature order. "
                  "Default: the feature's fixed table rows (--max_table_rows, "
                  "--cardinality_scale).")
flags.DEFINE_integer("dynamic_admit_after", None, "Sightings in training before a key gets a "
                     "row of a dynamic table (default 1).")
flags.DEFINE_enum("dynamic_evict", None, list(dynamic_tables.EVICT_CHOICES),
                  "Which key a full dynamic table evicts for a new one: lfu (default), lru, "
                  "or none (a full table refuses new keys).")
flags.DEFINE_integer("dynamic_ttl_steps", None, "Free a dynamic table's rows unseen for this "
                     "many steps (default: never).")
flags.DEFINE_integer("dynamic_stats_every", None, "Record the dynamic tables' counters every "
                     "N batches into --metrics_json (default: only at the end).")
flags.DEFINE_integer("open_key_lifetime", None, "synthetic_open: samples of stream time a key "
                     "of a drifting table lives before a new key takes its slot (default "
                     f"{data_lib.OPEN_KEY_LIFETIME}).")
flags.DEFINE_bool("xla", _DEFAULTS.xla, "Compile the dense towers with XLA.")
flags.DEFINE_bool("pipeline", _DEFAULTS.pipeline,
                  "Read the next batch and send its ids to their owners while this step "
                  "computes (tfhybrid.TrainPipeline; same results). --nopipeline runs the "
                  "phases one after another, for debugging.")
flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Global batch size.")
flags.DEFINE_integer("steps", None, "Steps per epoch (default: one pass over file data; "
                     "200 for synthetic data).")
flags.DEFINE_integer("epochs", _DEFAULTS.epochs, "Epochs.")
flags.DEFINE_integer("eval_batches", None, "Global eval batches (default: the whole split).")
flags.DEFINE_integer("embedding_dim", _DEFAULTS.embedding_dim, "Embedding width.")
flags.DEFINE_list("bottom_mlp_dims", [str(d) for d in _DEFAULTS.bottom_mlp_dims],
                  "DLRM bottom MLP; must end in --embedding_dim.")
flags.DEFINE_list("top_mlp_dims", [str(d) for d in _DEFAULTS.top_mlp_dims],
                  "Top MLP (DLRM) or deep tower (DCN-v2); must end in 1.")
flags.DEFINE_integer("num_cross_layers", _DEFAULTS.num_cross_layers, "DCN-v2 cross layers.")
flags.DEFINE_integer("projection_dim", None, "DCN-v2 low-rank cross projection.")
flags.DEFINE_integer("max_table_rows", _DEFAULTS.max_table_rows, "Caps every table's rows.")
flags.DEFINE_float("cardinality_scale", _DEFAULTS.cardinality_scale,
                   "Scales Criteo's table sizes (synthetic and criteo_tsv).")
flags.DEFINE_integer("column_slice_threshold", None, "Planner: column-slice tables above "
                     "this many elements.")
flags.DEFINE_integer("row_slice_threshold", None, "Planner: row-slice tables above this.")
flags.DEFINE_integer("data_parallel_threshold", None, "Planner: replicate tables below this.")
flags.DEFINE_integer("dram_budget", None, "Bytes of tables (and optimizer state) each rank "
                     "may hold in DRAM: the planner moves the largest tables to the disk "
                     "tier, a file per shard behind a DRAM cache, until every rank fits "
                     "(exact; embedding optimizer sgd or rowwise_adagrad). Needs "
                     "--store_dir. Default: every table in memory.")
flags.DEFINE_string("store_dir", None, "Folder of the disk tier's files (--dram_budget); "
                    "each rank writes its own subfolder.")
flags.DEFINE_bool("skip_malformed", False, "criteo_tsv: count and skip malformed lines "
                  "instead of failing.")
flags.DEFINE_string("checkpoint_dir", None, "Checkpoint folder (shared by all ranks).")
flags.DEFINE_integer("checkpoint_every", 0, "Save every N steps (0: only at the end).")
flags.DEFINE_bool("restore", False, "Restore the latest checkpoint (any mesh) first.")
flags.DEFINE_string("export_dir", None, "Write a single-process SavedModel here.")
flags.DEFINE_enum("export_tables", _DEFAULTS.export_tables, list(train_app.EXPORT_TABLES),
                  "inline: the SavedModel holds every table; external: the ranks that "
                  "hold them also write the tables into the Redis Cluster of --redis, "
                  "for tfhybrid.serving.Predictor (docs/serving.md).")
flags.DEFINE_enum("export_precision", _DEFAULTS.export_precision,
                  list(train_app.EXPORT_PRECISIONS),
                  "The external tables' rows: float32, float16 or int8 (row-wise).")
flags.DEFINE_string("redis", None, "host:port,... of the Redis Cluster of "
                    "--export_tables=external (keys prefixed by --export_dir's name).")
flags.DEFINE_string("redis_password_file", None, "A file holding the cluster's password.")
flags.DEFINE_string("redis_username", None, "The cluster's ACL user (default: default).")
# --log_dir is absl.logging's own flag; the app writes its TensorBoard logs there (rank 0)
flags.DEFINE_string("metrics_json", None, "Write the final figures as JSON here (rank 0).")
flags.DEFINE_integer("warmup_steps", _DEFAULTS.warmup_steps, "Steps left out of samples/s.")
flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed of the synthetic data (synthetic, "
                     "synthetic_open) and its teacher.")
flags.DEFINE_integer("threads", None, "TF threads per rank (default: cores / local ranks).")


def _stall_default(name: str) -> str:
    return (f"default: ${name} if set, else {mesh_lib.STALL_DEFAULTS[name]}; the flag "
            f"replaces ${name}")


flags.DEFINE_integer(
    "stall_check_seconds", None, "How often each rank (and Horovod) checks for a stall, a "
    "rank that stopped calling collectives, and warns of a slow step ("
    f"{_stall_default(mesh_lib.STALL_CHECK_ENV)}).")
flags.DEFINE_integer(
    "stall_shutdown_seconds", None, "Once no training step has finished for this long, "
    "Horovod is shut down and every rank fails; at least --stall_check_seconds ("
    f"{_stall_default(mesh_lib.STALL_SHUTDOWN_ENV)}).")

FLAGS = flags.FLAGS


def _ints(name: str) -> list[int]:
    try:
        return [int(v) for v in getattr(FLAGS, name)]
    except ValueError:
        raise app.UsageError(f"--{name}={','.join(getattr(FLAGS, name))} must be a "
                             "comma-separated list of integers") from None


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    conflict = keras_conflict(FLAGS.keras, USER_LEGACY_KERAS)
    if conflict:
        raise app.UsageError(conflict)
    if FLAGS.keras is not None and int(FLAGS.keras) != _tf_internals.KERAS_MAJOR:
        # tf.keras was chosen before this module ran (main called from a program)
        raise app.UsageError(f"--keras={FLAGS.keras} asks for Keras {FLAGS.keras}, but "
                             f"tf.keras is already Keras {_tf_internals.KERAS_MAJOR}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    values = {f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(train_app.TrainConfig)}
    values["bottom_mlp_dims"] = _ints("bottom_mlp_dims")
    values["top_mlp_dims"] = _ints("top_mlp_dims")
    values["dynamic_capacity"] = _ints("dynamic_capacity")
    values["log_dir"] = FLAGS.log_dir or None
    if values["steps"] is None and FLAGS.dataset in ("synthetic", "synthetic_open"):
        values["steps"] = 200
    config = train_app.config_from_dict(values)
    try:
        config.validate()
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    train_app.run(config)


if __name__ == "__main__":
    app.run(main)
