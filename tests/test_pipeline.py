"""TrainPipeline: reading a batch ahead changes when its ids travel, never the result.
(Its errors: ``tests/test_pipeline_errors.py``.)

Every comparison is exact (``assertAllEqual``): the pipelined step looks up after the
previous step's update, with the same ids, so nothing may differ in the last bit.
"""

import dataclasses
import re
import statistics

import tensorflow as tf

import tfhybrid
from tfhybrid import collectives as collectives_lib
from tfhybrid import mesh as mesh_lib
from tfhybrid import pipeline as pipeline_lib
from tfhybrid import optimizers
from tfhybrid.pipeline import TrainPipeline
from tests import _hybrid_case as hc

# four ranks only: 2x2 and 1x4 run both halves of the hybrid route, and 4x1 the API
# checks; one process would only repeat them without a collective
HOROVOD_NP = (4,)
KERAS = (2, 3)

# past the placement trial (TRIAL_STEPS + 1 steps of each placement), so the chosen
# placement trains too
STEPS = 2 * (pipeline_lib.TRIAL_STEPS + 1) + 4


def _fit(case, mesh, make_optimizer, pipeline, epochs=1, steps_per_execution=1,
         check=None, **layer_kwargs):
    """Weights and losses after ``model.fit``; ``check(pipeline)`` runs on the pipeline
    after training."""
    model, layer = case.compiled_model(mesh, make_optimizer, steps_per_execution,
                                       **layer_kwargs)
    if pipeline:
        pipeline = TrainPipeline(model)
    ids, labels = case.local_data(mesh.rank)
    history = model.fit(ids, labels, batch_size=case.local_batch, shuffle=False, verbose=0,
                        epochs=epochs)
    if check is not None:
        check(pipeline)
    return hc.model_weights(model, layer), history.history["loss"]


def _ancestors(op) -> set:
    """Every op ``op`` waits for, through data and control edges."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _custom_loop(case, mesh, make_optimizer, enabled, **layer_kwargs):
    model, layer = case.distributed_model(mesh, **layer_kwargs)
    optimizer = make_optimizer()

    def train_step(batch):
        ids, labels = batch
        with tf.GradientTape() as tape:
            loss = hc.loss_fn(labels, model(ids, training=True))
        tape = tfhybrid.DistributedGradientTape(tape, optimizer=optimizer)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    pipeline = TrainPipeline(model, tf.function(train_step), enabled=enabled)
    ids, labels = case.local_data(mesh.rank)
    data = tf.data.Dataset.from_tensor_slices((tuple(ids), labels)).batch(case.local_batch)
    iterator = iter(data)
    losses = [float(pipeline.progress(iterator)) for _ in range(case.steps)]
    with self_raises_stop_iteration():
        pipeline.progress(iterator)
    return hc.model_weights(model, layer), losses


def _assert_route_beside_step(test, pipeline) -> None:
    """In the pipelined step, the collectives of batch t+1's route (id check, ids
    alltoall) wait, in one placement, for the step's rows to arrive and for no later
    collective of the step (its gradients' alltoall and syncs), so they cross while the
    towers compute; in the other for nothing of the step, so they cross while it looks
    up. The preparation of batch t+2 waits for the step's rows to go into their
    alltoall. The pipeline times both and every rank keeps the same, faster one."""
    test.assertCountEqual(pipeline.traced_steps, pipeline_lib.PLACEMENTS)
    for after_rows, fn in pipeline.traced_steps.items():
        concrete = fn.get_concrete_function()
        collectives = [op for op in concrete.graph.get_operations()
                       if op.type.startswith("Horovod")]
        # a graph may add a number to an op's name (Horovod matches ranks by another name)
        rows = [op for op in collectives if re.search(r"_rows(_\d+)?$", op.name)]
        route = [op for op in collectives if re.search(r"_(validate|ids)(_\d+)?$", op.name)]
        test.assertNotEmpty(rows)
        test.assertNotEmpty(route)
        later = [op for op in collectives if op not in rows and op not in route
                 and set(rows) & _ancestors(op)]
        test.assertNotEmpty(later)   # the gradients' alltoall at least
        before_rows = set().union(*(_ancestors(op) for op in rows))
        for op in route:
            waits_for = _ancestors(op)
            if after_rows:
                test.assertContainsSubset(rows, waits_for, msg=op.name)
            else:
                test.assertNoCommonElements(rows, waits_for, msg=op.name)
            test.assertNoCommonElements(later, waits_for, msg=op.name)
        # each layer's prepared report (what its next route sends first) waits for work
        # of the step's rows: ops the rows alltoall waited for, not just the inputs (from
        # the op that makes it, not the function's output, which waits for every
        # stateful op)
        for sending in concrete.structured_outputs[4]:
            made = sending[0].op.inputs[0].op
            shared = {op for op in (_ancestors(made) | {made}) & before_rows
                      if op.type not in ("Placeholder", "Const", "ReadVariableOp", "NoOp")}
            test.assertNotEmpty(shared, msg=made.name)
    if pipeline.placement is None:
        return   # fewer steps than the timing takes
    # every rank chose the placement of the least mean of the ranks' median step times
    trial = pipeline.trial_seconds
    test.assertEqual([len(trial[p]) for p in pipeline_lib.PLACEMENTS],
                     [pipeline_lib.TRIAL_STEPS + 1] * 2)
    world = pipeline.layers[0].mesh.size
    medians = collectives_lib.allgather(tf.constant(
        [[statistics.median(trial[p][1:]) for p in pipeline_lib.PLACEMENTS]], tf.float64),
        world, "test_pipeline_medians").numpy()
    chosen = collectives_lib.allgather(tf.constant([[int(pipeline.placement)]]), world,
                                   "test_pipeline_chosen").numpy().reshape(-1)
    test.assertAllEqual(chosen, [int(pipeline_lib.PLACEMENTS[
        int(medians.mean(axis=0).argmin())])] * world)


class self_raises_stop_iteration:
    """The input is used up: the pipeline says so as a Python iterator would."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is not StopIteration:
            raise AssertionError(f"expected StopIteration after the last batch, got {kind}")
        return True


class PipelineEqualsPlainLoopTest(tf.test.TestCase):

    def tearDown(self):
        mesh_lib.reset()
        super().tearDown()

    def _assert_same(self, got, want):
        self.assertEqual(len(got), len(want))
        for g, w in zip(got, want):
            self.assertAllEqual(g, w)

    def test_fit_and_custom_loop_equal_the_plain_loop_bit_for_bit(self):
        world = hc.world_size()
        mesh_shapes = sorted({min(2, world), world})   # 2x2 and 1x4 (one process: 1x1)
        # (optimizer, layer options, model_parallel, steps of fit, steps of a custom
        # loop): fit through the placement trial on 2x2, the custom loop there too
        # (both halves of the route), shorter (its steps are fit's; test_gradient_route
        # holds the tape's route to the optimizer's)
        runs = [("rowwise_adagrad", lambda: optimizers.RowWiseAdagrad(0.1), {},
                 mesh_shapes[0], STEPS, 8),
                ("weight_sync", lambda: optimizers.MomentumScaledRowWiseAdagrad(0.1),
                 dict(replica_sync="weights", sync_every=3), mesh_shapes[0], 12, 0),
                ("sgd", lambda: tf.keras.optimizers.SGD(0.5), {}, mesh_shapes[-1], 12, 0)]
        for name, make, layer_kwargs, model_parallel, steps, loop_steps in runs:
            case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=steps, world=world,
                           seed=5)
            with self.subTest(optimizer=name, model_parallel=model_parallel, steps=steps):
                mesh = tfhybrid.init(model_parallel=model_parallel)
                plain, plain_loss = _fit(case, mesh, make, False, **layer_kwargs)
                piped, piped_loss = _fit(
                    case, mesh, make, True, check=lambda pipeline: _assert_route_beside_step(
                        self, pipeline), **layer_kwargs)
                self._assert_same(piped, plain)
                self.assertEqual(piped_loss, plain_loss)
                if loop_steps:
                    case = dataclasses.replace(case, steps=loop_steps)
                    looped, losses = _custom_loop(case, mesh, make, True, **layer_kwargs)
                    unpiped, unpiped_losses = _custom_loop(case, mesh, make, False,
                                                           **layer_kwargs)
                    self._assert_same(looped, unpiped)
                    self.assertEqual(losses, unpiped_losses)
                    self.assertLen(losses, loop_steps)
                mesh_lib.reset()

    def test_epochs_and_steps_per_execution(self):
        """A new epoch's iterator drops the batch read ahead from the old one (the plain
        loop never reads it); several steps per call pipeline inside the call."""
        world = hc.world_size()
        # 6 steps: four per call, then a call of two
        case = hc.Case(hc.PLACEMENT_TABLES, local_batch=2, steps=6, world=world, seed=6)
        make = lambda: optimizers.RowWiseAdagrad(0.1)  # noqa: E731
        mesh = tfhybrid.init(model_parallel=min(2, world))
        plain, plain_loss = _fit(case, mesh, make, False, epochs=2)
        for steps_per_execution in (1, 4):
            with self.subTest(steps_per_execution=steps_per_execution):
                piped, piped_loss = _fit(case, mesh, make, True, epochs=2,
                                         steps_per_execution=steps_per_execution)
                self._assert_same(piped, plain)
                if steps_per_execution == 1:
                    self.assertEqual(piped_loss, plain_loss)


if __name__ == "__main__":
    tf.test.main()
