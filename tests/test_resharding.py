"""The resharding math of checkpoints (tfhybrid/checkpoint/resharding.py): pure Python, no TensorFlow."""

from __future__ import annotations

import doctest
import itertools
import os
import subprocess
import sys
import unittest

from tfhybrid.checkpoint import resharding
from tfhybrid import plan as planning
from tfhybrid.checkpoint.resharding import Rect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tables() -> list[planning.TableConfig]:
    # a row-sliced, a column-sliced, a table-wise and a data-parallel table
    return [planning.TableConfig("big", 300, 8), planning.TableConfig("wide", 100, 8),
            planning.TableConfig("mid", 60, 6), planning.TableConfig("tiny", 20, 4)]


def _plan(data_parallel: int, model_parallel: int, **thresholds) -> planning.ShardingPlan:
    options = dict(data_parallel_threshold=100, row_slice_threshold=2000,
                   column_slice_threshold=600)
    options.update(thresholds)
    return planning.plan_sharding(_tables(), data_parallel, model_parallel, **options)


def _held(plan: planning.ShardingPlan, position: int) -> list[list[Rect]]:
    return [[rect for _, rect in resharding.held_pieces(p.kind, p.shards, position)]
            for p in plan.tables]


def _fill(rect: Rect, table: list[list[int]]) -> list[list[int]]:
    return [row[rect.col_start:rect.col_end] for row in table[rect.row_start:rect.row_end]]


class RectTest(unittest.TestCase):

    def test_bad_rectangles_name_the_values(self):
        for args in [(3, 2, 0, 1), (0, 1, -1, 2), (0, 1.0, 0, 1), (True, 2, 0, 1)]:
            with self.assertRaisesRegex(ValueError, r"Rect\(.*\) must be ints"):
                Rect(*args)

    def test_intersection_and_relative_coordinates(self):
        self.assertIsNone(Rect(0, 2, 0, 2).intersection(Rect(2, 4, 0, 2)))
        self.assertEqual(Rect(0, 4, 0, 4).intersection(Rect(1, 9, 3, 9)), Rect(1, 4, 3, 4))
        self.assertEqual(Rect(3, 5, 2, 4).relative_to(Rect(2, 6, 2, 8)), Rect(1, 3, 0, 2))
        with self.assertRaisesRegex(ValueError, "is not inside"):
            Rect(0, 5, 0, 1).relative_to(Rect(2, 6, 0, 8))


class HeldPiecesTest(unittest.TestCase):

    def test_every_placement_tiles_each_table_over_the_positions(self):
        for d, m in [(2, 2), (1, 4), (4, 1), (1, 1), (1, 2)]:
            plan = _plan(d, m)
            held = [_held(plan, p) for p in range(m)]
            for t, (config, placement) in enumerate(zip(_tables(), plan.tables)):
                rects = [rect for p in range(m) for rect in held[p][t]]
                if placement.kind == "data_parallel":
                    # every position holds the whole table; one copy tiles it
                    self.assertEqual(set(rects), {Rect(0, config.rows, 0, config.dim)})
                    rects = rects[:1]
                resharding.check_tiling(config.name, [config.rows, config.dim], rects)

    def test_kinds_on_2x2_and_1x4(self):
        self.assertEqual([t.kind for t in _plan(2, 2).tables],
                         ["row_wise", "column_wise", "table_wise", "data_parallel"])
        big = _held(_plan(1, 4), 1)[0]
        self.assertEqual(big, [Rect(75, 150, 0, 8)])
        self.assertEqual(len(_held(_plan(1, 4), 3)[3]), 1)


class SliceSpecTest(unittest.TestCase):

    def test_round_trip_in_tensorflow_format(self):
        self.assertEqual(resharding.slice_spec((300, 8), Rect(75, 150, 0, 8)),
                         "300 8 75,75:0,8")
        self.assertEqual(resharding.slice_spec([300], Rect(75, 150, 0, 8)), "300 75,75")
        for spec in ["300 8 75,75:0,8", "10 2,3", "4 2 0,4:1,1"]:
            shape, rect = resharding.parse_slice_spec(spec)
            self.assertEqual(resharding.slice_spec(shape, rect), spec)

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, r"does not fit in shape \[10, 4\]"):
            resharding.slice_spec([10, 4], Rect(0, 11, 0, 4))
        with self.assertRaisesRegex(ValueError, r"full_shape=\[1, 2, 3\]"):
            resharding.slice_spec([1, 2, 3], Rect(0, 1, 0, 1))
        for bad in ["", "10 4 a,b:0,4", "10 4 0,4"]:
            with self.assertRaisesRegex(ValueError, "slice spec"):
                resharding.parse_slice_spec(bad)


class WritersTest(unittest.TestCase):

    def test_each_piece_once_by_the_lowest_rank_holding_it(self):
        # 2x2 model_major: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1; everyone
        # holds the dense kernel and the whole data-parallel table
        def rank(shard):
            return [("kernel", "", "float32[4, 1]"), ("tiny", "20 4 0,20:0,4", "f[20, 4]"),
                    ("big", f"300 8 {150 * shard},150:0,8", "f[150, 8]")]

        writes = resharding.assign_writers([rank(0), rank(1), rank(0), rank(1)])
        self.assertEqual(writes, [
            [("kernel", ""), ("tiny", "20 4 0,20:0,4"), ("big", "300 8 0,150:0,8")],
            [("big", "300 8 150,150:0,8")], [], []])

    def test_copies_that_disagree_raise_naming_both_ranks(self):
        with self.assertRaisesRegex(ValueError, r"'kernel' \(slice ''\) is float32\[4, 1\] on "
                                                r"rank 0 but float32\[4, 2\] on rank 1"):
            resharding.assign_writers([[("kernel", "", "float32[4, 1]")],
                                        [("kernel", "", "float32[4, 2]")]])


class TilingTest(unittest.TestCase):

    def test_gaps_overlaps_and_strays(self):
        resharding.check_tiling("t", [4, 2], [Rect(2, 4, 0, 2), Rect(0, 2, 0, 2)])
        resharding.check_tiling("slot", [4], [Rect(0, 4, 0, 1)])
        with self.assertRaisesRegex(ValueError, "cover 4 of its 8 elements"):
            resharding.check_tiling("t", [4, 2], [Rect(0, 2, 0, 2)])
        with self.assertRaisesRegex(ValueError, "overlap"):
            resharding.check_tiling("t", [4, 2], [Rect(0, 3, 0, 2), Rect(2, 4, 0, 2)])
        with self.assertRaisesRegex(ValueError, "lies outside it"):
            resharding.check_tiling("t", [4, 2], [Rect(0, 4, 0, 3)])


class ReadsTest(unittest.TestCase):
    """Every target rectangle of a new plan is assembled exactly from the saved pieces."""

    def _check(self, saved_plan, new_plan):
        for t, config in enumerate(_tables()):
            table = [[r * 100 + c for c in range(config.dim)] for r in range(config.rows)]
            saved = sorted({rect for p in range(saved_plan.model_parallel)
                            for rect in _held(saved_plan, p)[t]})
            for position in range(new_plan.model_parallel):
                for target in _held(new_plan, position)[t]:
                    rows, cols = target.shape
                    got = [[None] * cols for _ in range(rows)]
                    for index, inside_piece, inside_target in resharding.reads(target, saved):
                        values = _fill(inside_piece, _fill(saved[index], table))
                        for i, row in enumerate(values):
                            got[inside_target.row_start + i][
                                inside_target.col_start:inside_target.col_end] = row
                    self.assertEqual(got, _fill(target, table),
                                     f"{config.name} {target} from {saved}")

    def test_2x2_to_1x4_4x1_and_one_process(self):
        saved = _plan(2, 2)
        for new in [_plan(1, 4), _plan(1, 4, column_slice_threshold=300),
                    _plan(4, 1, data_parallel_threshold=None), _plan(1, 1)]:
            self._check(saved, new)

    def test_uncovered_target_raises(self):
        with self.assertRaisesRegex(ValueError, "cover 8 of the 16 elements"):
            resharding.reads(Rect(0, 4, 0, 4), [Rect(0, 2, 0, 4)])


class RowwiseSlotTest(unittest.TestCase):

    def test_layout_of_slots(self):
        rect = Rect(10, 15, 2, 6)
        self.assertEqual(resharding.slot_layout([5, 4], rect), "full")
        self.assertEqual(resharding.slot_layout([5], rect), "rowwise")
        with self.assertRaisesRegex(ValueError, r"shape \[4\] belongs to no shard of \[5, 4\]"):
            resharding.slot_layout([4], rect)

    def test_weights_of_new_column_splits(self):
        old = [(0, 4), (4, 8)]
        self.assertEqual(resharding.rowwise_weights((0, 4), old), [1.0, 0.0])  # unchanged
        self.assertEqual(resharding.rowwise_weights((0, 8), old), [0.5, 0.5])  # merged
        for c0, c1 in itertools.combinations(range(9), 2):
            self.assertAlmostEqual(sum(resharding.rowwise_weights((c0, c1), old)), 1.0)
        with self.assertRaisesRegex(ValueError, r"target_cols=\(3, 3\)"):
            resharding.rowwise_weights((3, 3), old)


class DocTest(unittest.TestCase):

    def test_docstring_examples(self):
        failed, _ = doctest.testmod(sys.modules["tfhybrid.checkpoint.resharding"])
        self.assertEqual(failed, 0)

    def test_no_tensorflow(self):
        # in a fresh interpreter: the runner may have imported TensorFlow into this one
        # for a module before this one
        code = ("import sys, tfhybrid.checkpoint.resharding, tfhybrid.plan; "
                "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                "('tensorflow', 'horovod', 'keras', 'tf_keras')))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=ROOT, check=True)
        self.assertEqual(done.stdout.strip(), "[]", done.stderr)


if __name__ == "__main__":
    unittest.main()
