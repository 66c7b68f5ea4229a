"""Every patch tfhybrid makes to TensorFlow or Keras, each where they have no public hook,
each installed by an explicit, idempotent call (never by an import) that checks the
TensorFlow it was written for (``check_version``). The package docstring lists them."""

from __future__ import annotations

import contextvars
import os
from typing import Any, Callable

import tensorflow as tf
from tensorflow.python.checkpoint import functional_saver
from tensorflow.python.checkpoint import restore as restore_lib

from tfhybrid._tf_internals.versions import KERAS_3, check_version, hooks_written_for_this_tf


def install_autograph_rule(package: str = "tfhybrid") -> None:
    """Tells autograph not to convert ``package``'s functions, as TF's own rules do for
    ``tensorflow``, ``keras`` and ``tf_keras``. Idempotent.

    tfhybrid's graph code branches and loops on Python values only (the plan, static
    shapes), never on tensors: every rank must trace the same collectives, which a
    ``tf.cond`` around one could not promise. Converting it changes no op and costs
    time: a process spent 5 s of a 16 s test module (40% of an np=4 run's samples)
    transpiling the layer's and the gradient route's methods on first trace. A user's
    own function, and a user's subclass overriding a method, are still converted.
    The rules are a module-level tuple read on every conversion (TF 2.15 to 2.21).
    Installed by ``tfhybrid.init`` and by what a traced step calls into before it
    traces: the layers, tables, optimizers, the gradient route and the pipeline, when
    they are made. On a
    TensorFlow it was not written for it installs nothing (conversion is only slower
    then), so that making a layer never fails for it.
    """
    if not hooks_written_for_this_tf():
        return
    from tensorflow.python.autograph.core import config

    if not any(isinstance(r, config.DoNotConvert) and r.matches(package)
               for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config.DoNotConvert(package),) + tuple(
            config.CONVERSION_RULES)


# a hook's mark on what it installed, holding the callback it calls
_HOOK_MARK = "_tfhybrid_hook"


# the callbacks of an optimizer's build hook (install_build_hook)
_BUILD_HOOK_MARK = "_tfhybrid_build_callbacks"


SaveCallback = Callable[[Any, Any, Any, Callable[..., Any]], Any]


def install_saver_hook(save: SaveCallback) -> None:
    """Makes every checkpoint write call ``save(saver, file_prefix, options, original)``
    in place of ``MultiDeviceSaver.save``; ``original(saver, file_prefix, options)`` is
    TensorFlow's own. Idempotent; one callback per process."""
    check_version("MultiDeviceSaver.save")
    current = functional_saver.MultiDeviceSaver.save
    installed = getattr(current, _HOOK_MARK, None)
    if installed is save:
        return
    if installed is not None:
        raise RuntimeError("MultiDeviceSaver.save is hooked already, by another callback")

    def hooked_save(saver: Any, file_prefix: Any, options: Any = None) -> Any:
        return save(saver, file_prefix, options, current)

    setattr(hooked_save, _HOOK_MARK, save)
    functional_saver.MultiDeviceSaver.save = hooked_save


# The checkpoint a restore is reading, while TensorFlow gathers the objects to restore
_RESTORING: "contextvars.ContextVar[str | None]" = contextvars.ContextVar(
    "tfhybrid_restoring", default=None)


def install_restore_hook() -> None:
    """Makes the path of the checkpoint being restored known (``restoring_path``) while
    TensorFlow asks the objects what they restore: every restore path, eager or
    deferred, asks there. Idempotent."""
    check_version("CheckpointPosition.gather_ops_or_named_saveables")
    original = restore_lib.CheckpointPosition.gather_ops_or_named_saveables
    if getattr(original, _HOOK_MARK, False):
        return

    def gather_ops_or_named_saveables(position):
        token = _RESTORING.set(position.checkpoint.save_path_string)
        try:
            return original(position)
        finally:
            _RESTORING.reset(token)

    setattr(gather_ops_or_named_saveables, _HOOK_MARK, True)
    restore_lib.CheckpointPosition.gather_ops_or_named_saveables = \
        gather_ops_or_named_saveables


def restoring_path() -> str | None:
    """The checkpoint being restored while TensorFlow gathers what objects restore (with
    ``install_restore_hook``), else None."""
    return _RESTORING.get()


# checks that run before a Keras optimizer makes a slot, in the order installed
_SLOT_GUARDS: list[Callable[[Any, Any, Any], None]] = []


# the slot factories of the Keras optimizers: Keras 2's new and legacy ones; Keras 3 has
# one kind (its ``optimizers.legacy`` names stubs that refuse to be built)
_SLOT_FACTORIES = (((lambda: tf.keras.optimizers.Optimizer, "add_variable_from_reference"),)
                   if KERAS_3 else
                   ((lambda: tf.keras.optimizers.Optimizer, "add_variable_from_reference"),
                    (lambda: tf.keras.optimizers.legacy.Optimizer, "add_slot")))


# An optimizer that makes no slot for a variable (SGD without momentum: Keras 3's, and
# Keras 2's legacy one) would pass the slot guards unseen, so the guards also see each
# variable an optimizer is built with (with slot name None)
_BUILDS = (((lambda: tf.keras.optimizers.Optimizer, "build"),) if KERAS_3 else
           ((lambda: tf.keras.optimizers.Optimizer, "build"),
            (lambda: tf.keras.optimizers.legacy.Optimizer, "_create_all_weights")))


def install_slot_guard(check: Callable[[Any, Any, Any], None]) -> None:
    """Runs ``check(optimizer, variable, slot_name)`` before any Keras optimizer (new or
    legacy) makes a slot for ``variable``, and ``check(optimizer, variable, None)`` for
    each variable before an optimizer is built with it; it raises to refuse.
    Idempotent."""
    check_version("Keras optimizer slot factory")
    for factories, guard in ((_SLOT_FACTORIES, _guarded_slots), (_BUILDS, _guarded_build)):
        for base, name in factories:
            owner = next(k for k in base().__mro__ if name in vars(k))
            if not getattr(vars(owner)[name], _HOOK_MARK, False):
                setattr(owner, name, guard(vars(owner)[name]))
    if check not in _SLOT_GUARDS:
        _SLOT_GUARDS.append(check)


def _guarded_build(build: Callable) -> Callable:
    """``build`` (an optimizer's ``build(variables)``, a legacy one's
    ``_create_all_weights(variables)``) behind the installed guards."""
    def guarded_build(self, variables, *args, **kwargs):
        variables = list(variables)
        for variable in variables:
            for check in _SLOT_GUARDS:
                check(self, variable, None)
        return build(self, variables, *args, **kwargs)
    setattr(guarded_build, _HOOK_MARK, True)
    return guarded_build


def _guarded_slots(create: Callable) -> Callable:
    """``create`` (an optimizer's slot factory) behind the installed guards."""
    def create_slot(self, *args, **kwargs):
        # Keras 2's new optimizers: (model_variable, variable_name); its legacy ones:
        # (var, slot_name); Keras 3: (reference_variable, name)
        variable = args[0] if args else next(
            (kwargs[k] for k in ("model_variable", "var", "reference_variable")
             if k in kwargs), None)
        slot_name = args[1] if len(args) > 1 else next(
            (kwargs[k] for k in ("variable_name", "slot_name", "name") if k in kwargs), None)
        for check in _SLOT_GUARDS:
            check(self, variable, slot_name)
        return create(self, *args, **kwargs)
    setattr(create_slot, _HOOK_MARK, True)
    return create_slot


def install_build_hook(optimizer: Any, after_build: Callable[[], None]) -> None:
    """Replaces ``optimizer``'s build (legacy Keras: ``_create_all_weights``, where they
    make slots) by one that holds back the restorations waiting for its children while
    Keras builds, puts them back, then calls ``after_build()`` (each callback installed,
    in order). Idempotent per optimizer and callback.

    Keras creates some tracked lists in ``build``; TensorFlow would hand a restoration
    waiting for such a list to the new list itself, whose positions are mesh-dependent;
    ``after_build`` hands them to the mesh-independent views instead.
    """
    check_version("optimizer build")
    method = "_create_all_weights" if hasattr(optimizer, "get_slot_names") else "build"
    own_build = getattr(optimizer, method)
    # a mark of its own: the build it wraps may be a class's, guarded by a slot guard
    callbacks = getattr(own_build, _BUILD_HOOK_MARK, None)
    if callbacks is not None:
        if after_build not in callbacks:
            callbacks.append(after_build)
        return
    callbacks = [after_build]

    def build(*args, **kwargs):
        waiting = dict(optimizer._deferred_dependencies)
        optimizer._deferred_dependencies.clear()
        # Keras 2 builds under tf.init_scope; Keras 3 inside the traced step, where the
        # restorations below would become ops of every step instead of running once
        with tf.init_scope():
            try:
                return own_build(*args, **kwargs)
            finally:
                for name, positions in waiting.items():
                    optimizer._deferred_dependencies.setdefault(name, []).extend(positions)
                for callback in callbacks:
                    callback()

    setattr(build, _BUILD_HOOK_MARK, callbacks)
    # an instance attribute, past Keras' __setattr__, which would track it
    object.__setattr__(optimizer, method, build)


def wrap_apply_gradients(optimizer: Any, apply: Callable[..., Any]) -> None:
    """Makes ``optimizer.apply_gradients(...)`` call ``apply(own_apply, ...)`` on this
    instance (``own_apply`` is its method before), for an optimizer whose class is the
    user's. Idempotent per optimizer."""
    check_version("optimizer apply_gradients")
    own_apply = optimizer.apply_gradients
    if getattr(own_apply, _HOOK_MARK, False):
        return

    def apply_gradients(*args, **kwargs):
        return apply(own_apply, *args, **kwargs)

    setattr(apply_gradients, _HOOK_MARK, True)
    # an instance attribute, past Keras' __setattr__, which would track it
    object.__setattr__(optimizer, "apply_gradients", apply_gradients)


def install_weights_file_hook(save: Callable[..., Any]) -> None:
    """Makes Keras 3's ``model.save_weights`` call ``save(model, filepath, original,
    *args, **kwargs)`` in place of ``saving_lib.save_weights_only`` (``original``):
    Keras 3 writes a weights file from every process that saves, and a file of sharded
    tables needs every rank's part but one writer. Idempotent; one callback."""
    check_version("Keras 3 save_weights_only")
    from keras.src.saving import saving_lib
    current = saving_lib.save_weights_only
    installed = getattr(current, _HOOK_MARK, None)
    if installed is save:
        return
    if installed is not None:
        raise RuntimeError("save_weights_only is hooked already, by another callback")

    def save_weights_only(model, filepath, *args, **kwargs):
        return save(model, filepath, current, *args, **kwargs)

    setattr(save_weights_only, _HOOK_MARK, save)
    saving_lib.save_weights_only = save_weights_only


def install_shared_folder_hook() -> None:
    """Makes Keras 3's ``file_utils.makedirs`` accept a local folder that exists once
    it returns. Keras' callbacks check that a folder is missing, then create it; when
    every rank of a job runs the callback, another rank can create it in between, and
    Keras' ``os.makedirs`` then fails on that rank alone, which leaves the others in a
    collective. A path that exists as a file still fails. Idempotent."""
    check_version("Keras 3 file_utils.makedirs")
    from keras.src.utils import file_utils
    current = file_utils.makedirs
    if getattr(current, _HOOK_MARK, False):
        return

    def makedirs(path):
        try:
            return current(path)
        except FileExistsError:
            if file_utils.is_remote_path(path) or not os.path.isdir(path):
                raise
            return None

    setattr(makedirs, _HOOK_MARK, True)
    file_utils.makedirs = makedirs


def install_backup_cleanup_hook(clean_up: Callable[[Any, Callable[[], None]], None]) -> None:
    """Makes Keras 3's ``BackupAndRestore.on_train_end`` call ``clean_up(callback,
    own)`` (``own()`` runs Keras' own: it deletes the backup folder). Every rank of a
    job runs the callback and would delete the same files at once. Idempotent; one
    callback."""
    check_version("Keras 3 BackupAndRestore.on_train_end")
    from keras.src.callbacks import backup_and_restore
    cls = backup_and_restore.BackupAndRestore
    current = cls.on_train_end
    installed = getattr(current, _HOOK_MARK, None)
    if installed is clean_up:
        return
    if installed is not None:
        raise RuntimeError("BackupAndRestore.on_train_end is hooked already, by another "
                           "callback")

    def on_train_end(self, logs=None):
        return clean_up(self, lambda: current(self, logs))

    setattr(on_train_end, _HOOK_MARK, clean_up)
    cls.on_train_end = on_train_end


def replace_own_variables(obj: Any, save: Callable[[Any], None],
                          load: Callable[[Any], None]) -> None:
    """Makes Keras 3's weights files ask ``save(store)`` / ``load(store)`` for ``obj``'s
    state (an optimizer whose class is the user's), in place of its own
    ``save_own_variables`` / ``load_own_variables``."""
    # instance attributes, past Keras' __setattr__, which would track them
    object.__setattr__(obj, "save_own_variables", save)
    object.__setattr__(obj, "load_own_variables", load)


def mark_built(layer: Any) -> None:
    """Marks a Keras ``layer`` built after its ``build`` ran, as Keras' own first call
    does: a ``build`` that does not call ``super().build()`` leaves ``built`` False, and
    the first call would build it again."""
    layer.built = True


def replace_make_train_function(model: Any,
                                make: Callable[[Callable[..., Any], bool], Any]) -> None:
    """Makes ``model.fit`` step with the train function ``make(own_make, force)`` returns
    (``own_make``: the ``make_train_function`` the model had, to fall back on), and drops
    the one it built. Keras 2 (2.15, 2.21) and Keras 3 both call
    ``model.make_train_function()`` when ``fit`` starts and step through
    ``model.train_function``, and neither has a public hook for a train function of
    one's own. A ``make`` that falls back on ``own_make`` gets what the model's own
    gives: Keras 3's sets ``model.train_function`` and returns None, Keras 2's returns
    it too."""
    check_version("Keras make_train_function")
    own_make = model.make_train_function

    def make_train_function(force: bool = False) -> Any:
        function = make(own_make, force)
        if function is not None:
            model.train_function = function   # where fit and Keras' own make leave it
        return function

    setattr(make_train_function, _HOOK_MARK, (own_make, make))
    model.make_train_function = make_train_function
    model.train_function = None


def restore_make_train_function(model: Any, make: Callable[..., Any]) -> None:
    """Undoes ``replace_make_train_function(model, make)``: ``fit`` builds its train
    function as before it again. A model whose train function another ``make`` replaced
    since is left alone."""
    installed = getattr(model.make_train_function, _HOOK_MARK, None)
    if installed is None or installed[1] != make:
        return
    model.make_train_function = installed[0]
    model.train_function = None
