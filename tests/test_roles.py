"""tfhybrid.roles: the registry of what each variable is."""

import gc
import importlib
import inspect
import re
import textwrap
import weakref

import tensorflow as tf

import tfhybrid  # noqa: F401 - before tf.keras is used: checks which Keras it is
from tfhybrid import roles

# the registry, the traits and the route's examples hold in both Kerases
KERAS = (2, 3)


class RolesTest(tf.test.TestCase):

    def test_facts_accumulate_and_others_keep_defaults(self):
        shard = tf.Variable(tf.zeros([4, 2]))
        roles.assign(shard, model_parallel=True)
        roles.assign(shard, table_key="layer/users", sync_every=3)
        role = roles.role_of(shard)
        self.assertEqual((role.model_parallel, role.table_key, role.sync_every),
                         (True, "layer/users", 3))
        self.assertFalse(role.embedding)
        self.assertEqual(roles.role_of(tf.Variable(1.0)), roles.Role())

    def test_an_unknown_fact_is_named(self):
        with self.assertRaisesRegex(ValueError, r"\['shardd'\]"):
            roles.assign(tf.Variable(1.0), shardd=True)

    def test_entries_leave_with_their_object_and_tables_are_held_weakly(self):
        class Table:
            pass

        table, pool = Table(), tf.Variable(tf.zeros([2, 2]))
        roles.assign(pool, table=table)
        self.assertIs(roles.role_of(pool).table, table)
        dead_table = weakref.ref(table)
        del table
        gc.collect()
        # the registry does not keep the table alive
        self.assertIsNone(dead_table())
        self.assertIsNone(roles.role_of(pool).table)
        # the pool's own entry leaves with it (a count of all entries would also move
        # with whatever else a shared process frees meanwhile)
        dead_role = weakref.ref(roles.role_of(pool))
        del pool
        gc.collect()
        self.assertIsNone(dead_role())

    def test_gradients_can_be_marked_in_a_trace(self):
        @tf.function
        def step(x):
            y = x * 2.0
            roles.assign(y, synced=True)
            return roles.role_of(y).synced, roles.role_of(x * 3.0).synced

        marked, unmarked = step(tf.constant(1.0))
        self.assertTrue(marked)
        self.assertFalse(unmarked)

    def test_a_table_names_the_row_state_and_the_step_weakly(self):
        class Table:
            pass

        table, pool, state = Table(), tf.Variable(tf.zeros([2, 2])), tf.Variable([0.0, 0.0])
        roles.assign(pool, row_accumulator=state, row_step=table)
        self.assertIs(roles.role_of(pool).row_accumulator, state)
        self.assertIs(roles.role_of(pool).row_step, table)
        del table
        gc.collect()
        self.assertIsNone(roles.role_of(pool).row_step)


class TraitsTest(tf.test.TestCase):

    def test_optimizers_advertise_what_they_train(self):
        from tfhybrid.optimizer_traits import Trains, trains_of
        from tfhybrid.optimizers import MomentumScaledRowWiseAdagrad, RowWiseAdagrad
        self.assertIs(trains_of(RowWiseAdagrad()), Trains.ROW_STATE)
        self.assertIs(trains_of(MomentumScaledRowWiseAdagrad()), Trains.ROW_STATE)
        self.assertIs(trains_of(tf.keras.optimizers.SGD(0.1)), Trains.NO_STATE)
        for stateful in (tf.keras.optimizers.SGD(0.1, momentum=0.5),
                         tf.keras.optimizers.SGD(0.1, nesterov=True),
                         tf.keras.optimizers.Adagrad(), tf.keras.optimizers.Adam()):
            self.assertIs(trains_of(stateful), Trains.DENSE_STATE, stateful)

    def test_a_bad_trait_is_named(self):
        from tfhybrid.optimizer_traits import advertises
        with self.assertRaisesRegex(ValueError, "'row_state'"):
            advertises("row_state")


# modules below the layer whose module and public-class docstrings carry examples
EXAMPLE_MODULES = ("tfhybrid.roles", "tfhybrid.slot_owners", "tfhybrid.optimizer_traits",
                   "tfhybrid.distributed.options", "tfhybrid.distributed.gradients",
                   "tfhybrid.distributed.sync", "tfhybrid.distributed.clipping",
                   "tfhybrid.distributed.weight_sync", "tfhybrid.distributed.route",
                   "tfhybrid.distributed.tape", "tfhybrid.distributed.optimizer",
                   "tfhybrid.distributed.broadcast")


# "Example::" or "Example (one process: ...)::", then the code to the end of the docstring
EXAMPLE = re.compile(r"^Example[^\n]*::\n", re.MULTILINE)


class ExamplesTest(tf.test.TestCase):

    def test_module_and_public_class_examples_run(self):
        ran = []
        for name in EXAMPLE_MODULES:
            module = importlib.import_module(name)
            docs = [inspect.getdoc(module) or ""] + [
                inspect.getdoc(member) or "" for member_name, member in inspect.getmembers(
                    module, lambda m: inspect.isclass(m) or inspect.isfunction(m))
                if member.__module__ == name and not member_name.startswith("_")]
            for doc in docs:
                example = EXAMPLE.search(doc)
                if example is not None:
                    with self.subTest(module=name):
                        exec(textwrap.dedent(doc[example.end():]), {})  # pylint: disable=exec-used
                    ran.append(name)
        # every module has one, in its docstring or a public class's or function's
        self.assertEqual(sorted(set(ran)), sorted(EXAMPLE_MODULES))

    def test_public_classes_have_examples(self):
        for name in EXAMPLE_MODULES:
            module = importlib.import_module(name)
            for cls_name, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == name and not cls_name.startswith("_"):
                    self.assertRegex(inspect.getdoc(cls) or "", EXAMPLE, f"{name}.{cls_name}")


if __name__ == "__main__":
    tf.test.main()
