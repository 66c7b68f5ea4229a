"""tfhybrid.roles: the registry of what each variable is."""

import gc
import weakref

import tensorflow as tf

import tfhybrid  # noqa: F401 - before tf.keras is used: checks it is Keras 2
from tfhybrid import roles


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
        roles.assign(pool, chunked_table=table)
        self.assertIs(roles.role_of(pool).chunked_table, table)
        dead_table = weakref.ref(table)
        del table
        gc.collect()
        # the registry does not keep the table alive
        self.assertIsNone(dead_table())
        self.assertIsNone(roles.role_of(pool).chunked_table)
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


if __name__ == "__main__":
    tf.test.main()
