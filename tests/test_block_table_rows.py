"""The model runner's block tables kept across steps (engine/block_table_rows.py): rows
written only for a new table, gathered padded with block 0, freed and reused, grown."""
import numpy as np
import pytest

from pagedllm.attention import AttentionMetadata
from pagedllm.engine.block_table_rows import BlockTableRows


def test_a_row_is_written_for_a_new_tuple_and_not_for_the_same_one():
    rows = BlockTableRows(num_rows=4, width=4)
    table = (7, 3)
    row = rows.row_of("a", table)
    assert rows.array[row, :2].tolist() == [7, 3]
    rows.array[row, 0] = 99  # what a rewrite would undo
    assert rows.row_of("a", table) == row and rows.array[row, 0] == 99  # same tuple: no write
    assert rows.row_of("a", tuple([7, 3])) == row and rows.array[row, 0] == 7  # a new one: written


def test_a_list_is_written_every_time():
    """A hand-made plan's list may have changed in place: never trusted by identity."""
    rows = BlockTableRows(num_rows=2, width=4)
    table = [1, 2]
    row = rows.row_of("a", table)
    table.append(5)
    rows.row_of("a", table)
    assert rows.array[row, :3].tolist() == [1, 2, 5]


def test_gather_cuts_each_row_at_its_count_and_pads_with_block_zero():
    rows = BlockTableRows(num_rows=4, width=8)
    a = rows.row_of("a", (5, 6, 7, 8))
    b = rows.row_of("b", (9,))
    # A shorter table after a longer one leaves stale entries in the row: never read.
    rows.row_of("a", (5, 6))
    tables = rows.gather([a, b, a], [2, 1, 1])
    assert tables.tolist() == [[5, 6], [9, 0], [5, 0]]
    assert rows.gather([], []).tolist() == [[0]]


def test_rows_are_freed_reused_and_grown():
    rows = BlockTableRows(num_rows=2, width=2)
    first = rows.row_of("a", (1,))
    rows.row_of("b", (2,))
    rows.forget("a")
    assert len(rows) == 1
    assert rows.row_of("c", (3,)) == first  # the freed row
    wide = tuple(range(10, 15))
    d = rows.row_of("d", wide)  # more rows and more columns than at the start
    assert len(rows) == 3 and rows.array.shape[1] >= 5
    assert rows.gather([rows.row_of("b", (2,)), d], [1, 5]).tolist() == [[2, 0, 0, 0, 0],
                                                                         list(wide)]
    rows.forget("unknown")  # nothing to do


@pytest.mark.parametrize("seq_lens", [[5, 1, 12], [16, 17]])
def test_from_tables_is_what_build_makes(seq_lens):
    """The runner's gathered tables give the metadata build() makes from the lists."""
    bs = 4
    tables = [tuple(range(10 * i, 10 * i + -(-n // bs) + 1)) for i, n in enumerate(seq_lens)]
    slots = list(range(len(seq_lens)))
    starts = list(range(len(seq_lens) + 1))
    built = AttentionMetadata.build(slots, starts, seq_lens, tables, bs)
    rows = BlockTableRows()
    gathered = rows.gather([rows.row_of(str(i), t) for i, t in enumerate(tables)],
                           [-(-n // bs) for n in seq_lens])
    made = AttentionMetadata.from_tables(slots, starts, seq_lens, gathered, bs)
    assert np.array_equal(made.block_tables.numpy(), built.block_tables.numpy())
    for i, n in enumerate(seq_lens):
        assert made.blocks_of(i).tolist() == list(tables[i][:-(-n // bs)])
