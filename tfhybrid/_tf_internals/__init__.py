"""The one door between tfhybrid and TensorFlow's and Keras' private structures.

This package is the only place in tfhybrid that imports ``tensorflow.python`` (or
Keras' ``src``), reads a private attribute of a TensorFlow or Keras object, sets an
attribute on one, or patches a TensorFlow or Keras class or instance. TF upgrades break
exactly these places, so each names the versions it covers and why the private structure
is touched at all. Supported: TensorFlow 2.15 and 2.21, with tf-keras of the same version
or (2.21) Keras 3 as ``tf.keras``. The rest of tfhybrid reads it as one module,
``_tf_internals.<name>``; by job:

- ``versions``: ``TF_VERSION``, ``KERAS_MAJOR`` / ``KERAS_3`` (which Keras ``tf.keras``
  is: any other is refused at import, naming it), ``HOOKS_WRITTEN_FOR`` and
  ``check_version``, which every hook that patches a TensorFlow or Keras class or
  instance calls when it is installed: another TensorFlow is refused, naming it and the
  hook.
- ``keras_switch``: every difference between the two Kerases that tfhybrid meets in
  layers and tables (``add_weight``, ``tf_variable``, ``table_variable``, slot names
  ``is_slot_of`` / ``state_name``, ``real_variables``, ``in_symbolic_call``,
  ``scattering_sgd``, ``without_xla_update``, ``built_for``, ``count_train_step``,
  ``steps_per_execution``); ``loss_scaling``: Keras 2's and 3's loss-scale optimizers
  (``loss_scale``, ``applied_gradient_scale``, ``scaled_loss``, ``gradients_to_apply``,
  ``apply_unscaled``); ``optimizer_base``: ``OptimizerBase``, the base of tfhybrid's
  optimizers.
- ``reads``: private reads where no public API answers: what a ``MultiDeviceSaver``
  holds (``saver_entries``, ``registered_savers``), an optimizer's cached checkpoint
  children (``forget_checkpoint_children``), checkpoint children (``children_of``,
  ``child_named``, ``waiting_children``, ``restore_waiting_child``, ``track_child``),
  traced functions (``tf_functions_in``, ``traced_functions``, ``call_concrete``,
  ``has_flat_call``), a model's layers (``layers_in``), a variable's path and its
  ``tf.distribute`` containers (``variable_path``, ``distributed_containers``), Keras 2's
  one-hot-matmul lookup (``uses_one_hot_matmul``), a legacy optimizer's slot build
  (``build_optimizer``), the XLA context (``in_xla_context``), a sparse read's tape
  record (``variable_accessed``); TF's legacy checkpoint classes (``SaveableObject``,
  ``SaveSpec``, ``Trackable``, ``SaveType``, ``ListWrapper``) and raw save ops
  (``save_v2``, ``merge_v2_checkpoints``) are handed out from there.
- ``hooks``: every patch, each installed by an explicit, idempotent call, never by an
  import:

  - ``install_autograph_rule`` adds tfhybrid to autograph's module rules (exempt from
    conversion, as TF and Keras exempt themselves; there is only a per-function
    decorator). Installed by ``tfhybrid.init`` and when a layer, table, optimizer,
    route or pipeline is made; on another TensorFlow it installs nothing.
  - ``install_saver_hook`` patches ``MultiDeviceSaver.save``: every Keras and TF save
    path ends there, and a save of sharded tables needs every rank to write its part of
    one checkpoint; TF's savers write a whole checkpoint per process. The checkpoint
    writer (``tfhybrid/checkpoint/writer.py``) installs it when a
    ``DistributedEmbedding`` is built.
  - ``install_restore_hook`` patches ``CheckpointPosition.gather_ops_or_named_saveables``:
    a kind's saved shape (a FIITED table's) depends on the checkpoint being read, and TF
    tells a saveable nothing about it; the hook names the path (``restoring_path``) while TF
    gathers. Installed with the saver hook (``tfhybrid/checkpoint/tables.py``).
  - ``install_slot_guard`` wraps the Keras optimizers' slot factories and builds: a slot
    per entry of a tiered cache or a FIITED pool would be wrong, and Keras has no hook
    to refuse one. Installed when such a table is made.
  - ``install_build_hook`` replaces ``build`` of an optimizer instance: Keras makes
    tracked lists there, and TF hands a waiting restoration to a new list by position;
    the hook holds waiting restorations back so the mesh-independent views get them.
    Installed when an optimizer is attached (``tfhybrid/checkpoint/slots.py``).
  - ``wrap_apply_gradients`` replaces ``apply_gradients`` of an optimizer instance that a
    ``DistributedGradientTape`` was given, so it runs the route's last steps.
  - ``replace_own_variables`` replaces an optimizer instance's
    ``save_own_variables`` / ``load_own_variables`` for Keras 3 weights files.
  - ``install_weights_file_hook`` (Keras 3) patches ``saving_lib.save_weights_only``: a
    ``.weights.h5`` of sharded tables needs every rank's part and one writer
    (``tfhybrid/checkpoint/weights_file.py``). With it, ``install_backup_cleanup_hook``
    patches ``BackupAndRestore.on_train_end`` (every rank runs the callback, one must
    delete the backup, once the others are done) and ``install_shared_folder_hook``
    patches ``file_utils.makedirs`` (every rank's callbacks create the same folder).
  - ``replace_make_train_function`` / ``restore_make_train_function`` swap a Keras model
    instance's ``make_train_function``, so ``model.fit`` steps through the train
    pipeline's function (``tfhybrid/pipeline.py``); ``mark_built`` marks a user's
    custom table layer built after tfhybrid built it.

Checkpoints hold tables and their slots under mesh-independent keys through TF's own
extension points: ``_gather_saveables_for_checkpoint`` nodes (the layer's ``tables``,
the optimizer's ``tfhybrid_table_slots``), ``Trackable`` children that stand in for
an optimizer's numbered lists, and ``SaveableObject`` subclasses; those stay in their
modules: ``checkpoint/pieces.py`` (``FullTensorSaveable``, a dense table's slices),
``checkpoint/tables.py`` and ``slots.py`` (the nodes), and a storage kind's own saved
layout, ``fiited/saved.py`` (``_CompactSaveable``, a FIITED table's compact chunks, which
reads ``restoring_path``).

Example::

    from tfhybrid import _tf_internals
    assert _tf_internals.TF_VERSION >= (2, 15)
    assert _tf_internals.KERAS_MAJOR in (2, 3)
"""

from __future__ import annotations

# first: which Keras tf.keras is, refused at import when it is neither
from tfhybrid._tf_internals.versions import (HOOKS_WRITTEN_FOR, KERAS_3, KERAS_MAJOR,
                                             TF_VERSION, check_version)
from tfhybrid._tf_internals.reads import (
    ListWrapper, SaveableObject, SaveSpec, SaveType, Trackable, build_optimizer,
    call_concrete, child_named, children_of, distributed_containers,
    forget_checkpoint_children, has_flat_call, in_xla_context, layers_in,
    merge_v2_checkpoints, registered_savers, restore_waiting_child, save_v2, saver_entries,
    tf_functions_in, traced_functions, track_child, uses_one_hot_matmul, variable_accessed,
    variable_path, waiting_children)
from tfhybrid._tf_internals.keras_switch import (
    add_weight, built_for, count_train_step, in_symbolic_call, is_slot_of, real_variables,
    scattering_sgd, state_name, steps_per_execution, table_variable, tf_variable,
    without_xla_update)
from tfhybrid._tf_internals.loss_scaling import (
    applied_gradient_scale, apply_unscaled, gradients_to_apply, is_loss_scale_optimizer,
    loss_scale, scaled_loss)
from tfhybrid._tf_internals.optimizer_base import OptimizerBase
from tfhybrid._tf_internals.hooks import (
    SaveCallback, install_autograph_rule, install_backup_cleanup_hook, install_build_hook,
    install_restore_hook, install_saver_hook, install_shared_folder_hook,
    install_slot_guard, install_weights_file_hook, mark_built, replace_make_train_function,
    replace_own_variables, restore_make_train_function, restoring_path,
    wrap_apply_gradients)
