import itertools
import random

import numpy as np
import pytest

from service.modeling.grouping import lay_out, length_groups, pack_rows


def cost(groups: list[list[int]], lengths: list[int], overhead: int) -> int:
    return sum(overhead + len(g) * max(lengths[k] for k in g) for g in groups)


def set_partitions(items: list[int]):
    """Every partition of ``items`` into non-empty groups (any grouping, not only length-sorted runs)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first], *part]
        for g in range(len(part)):
            yield [*part[:g], [first, *part[g]], *part[g + 1 :]]


def fits(groups: list[list[int]], lengths: list[int], budget: int) -> bool:
    return all(len(g) == 1 or len(g) * max(lengths[k] for k in g) <= budget for g in groups)


@pytest.mark.parametrize("seed", range(40))
def test_optimal_among_every_grouping_within_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 7))]
    overhead, budget = rng.choice([0, 8, 48, 200]), rng.choice([60, 120, 10_000])
    groups = length_groups(lengths, overhead, budget)
    assert sorted(k for g in groups for k in g) == list(range(len(lengths)))  # each index exactly once
    assert fits(groups, lengths, budget)
    for g in groups:  # shortest first within a group and from group to group
        assert [lengths[k] for k in g] == sorted(lengths[k] for k in g)
    assert [lengths[g[0]] for g in groups] == sorted(lengths[g[0]] for g in groups)
    brute = min(cost(p, lengths, overhead) for p in set_partitions(list(range(len(lengths))))
                if fits(p, lengths, budget))
    assert cost(groups, lengths, overhead) == brute


def every_cut(lengths: list[int], overhead: int, budget: int) -> int:
    """The cheapest grouping's cost by the dynamic program over every cut of the length-sorted order."""
    ordered = sorted(lengths)
    best = [0] * (len(ordered) + 1)
    for j in range(1, len(ordered) + 1):
        best[j] = min(best[i] + overhead + (j - i) * ordered[j - 1] for i in range(j)
                      if i == j - 1 or (j - i) * ordered[j - 1] <= budget)
    return best[-1]


@pytest.mark.parametrize("seed", range(60))
def test_as_cheap_as_trying_every_cut_on_hundreds_of_sequences(seed: int) -> None:
    """Where the budget cuts, only the runs' ends and the ends of full groups are tried as cuts: as cheap as all."""
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 70), rng.randint(5, 9), 40]) for _ in range(rng.randint(1, 300))]
    overhead, budget = rng.choice([0, 8, 128, 2000]), rng.choice([50, 300, 1000, 4096, 16384])
    groups = length_groups(lengths, overhead, budget)
    assert sorted(k for g in groups for k in g) == list(range(len(lengths)))
    assert fits(groups, lengths, budget)
    assert cost(groups, lengths, overhead) == every_cut(lengths, overhead, budget)


def test_the_two_extremes_and_the_budget() -> None:
    lengths = [30, 7, 69, 31, 8, 30]
    # a call costs nothing: every distinct length its own group, no padding at all
    groups = length_groups(lengths, 0, 10_000)
    assert all(len({lengths[k] for k in g}) == 1 for g in groups)
    # a call costs more than any padding: one group
    assert length_groups(lengths, 10_000, 10_000) == [[1, 4, 0, 5, 3, 2]]
    # the budget cuts a group however costly calls are; a sequence longer than it goes alone
    assert sorted(len(g) for g in length_groups([10] * 5, 10_000, 20)) == [1, 2, 2]
    assert length_groups([50, 5], 10_000, 20) == [[1], [0]]
    assert length_groups([], 64, 100) == []


def test_random_tweets_in_a_batch_are_cut_into_a_few_groups() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(7, 69) for _ in range(16)]
    groups = length_groups(lengths, 64, 16384)
    padded = sum(len(g) * max(lengths[k] for k in g) for g in groups)
    assert 1 < len(groups) < 16
    assert padded < 16 * max(lengths)
    assert len(list(itertools.chain(*groups))) == 16


@pytest.mark.parametrize("seed", range(30))
def test_rows_hold_every_index_once_within_their_length(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 69) for _ in range(rng.randint(1, 40))]
    limit = rng.choice([69, 100, 512])
    L, rows = pack_rows(lengths, limit, 384)
    assert sorted(k for row in rows for k in row) == list(range(len(lengths)))
    assert max(lengths) <= L <= max(limit, max(lengths))
    assert all(sum(lengths[k] for k in row) <= L for row in rows)
    # never more positions than one row per index padded to the longest
    assert len(rows) * L <= len(lengths) * max(lengths) * 2
    assert pack_rows([], limit, 384) == (0, [])


def test_random_tweets_waste_little_when_packed() -> None:
    rng = random.Random(0)
    wasted = padded = 0
    for _ in range(100):
        lengths = [rng.randint(7, 69) for _ in range(16)]
        L, rows = pack_rows(lengths, 512, 384)
        wasted += len(rows) * L - sum(lengths)
        padded += 16 * max(lengths) - sum(lengths)
    assert wasted < padded / 3


def test_lay_out_pads_each_block_in_place_and_packs_the_rest_after_the_blocks() -> None:
    lengths = np.array([3, 1, 4, 2, 5])
    layout = lay_out(lengths, [[1, 3], [4]])
    # block 0: sequences 1 and 3 padded to 2 (rows 0-3); block 1: sequence 4 (rows 4-8); then 0 and 2, back to back
    assert layout.blocks == [(0, 2, 2), (4, 1, 5)]
    assert layout.first.tolist() == [9, 0, 12, 2, 4] and layout.rows == 16
    starts = np.cumsum(lengths) - lengths
    for s, n in enumerate(lengths):  # every token in its sequence's rows, in order
        assert layout.dest[starts[s] : starts[s] + n].tolist() == list(range(layout.first[s], layout.first[s] + n))
    assert layout.pad_rows.tolist() == [1]  # sequence 1's second slot
    assert len(set(layout.dest.tolist()) | set(layout.pad_rows.tolist())) == layout.rows  # every row written once
    with pytest.raises(AssertionError):
        lay_out(lengths, [[1, 1]])


def test_lay_out_without_blocks_is_the_stream() -> None:
    lengths = np.array([2, 3])
    layout = lay_out(lengths, [])
    assert layout.dest.tolist() == list(range(5)) and layout.rows == 5 and not len(layout.pad_rows)


@pytest.mark.parametrize("seed", range(10))
def test_lay_out_of_random_blocks_as_laid_one_by_one(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 70, int(rng.integers(1, 300)))
    perm = rng.permutation(len(lengths))
    cuts = np.sort(rng.choice(np.arange(1, len(lengths) + 1), size=min(len(lengths), 8), replace=False))
    blocks = [perm[a:b].tolist() for a, b in zip(np.r_[0, cuts[:-1]], cuts, strict=True)]
    layout = lay_out(lengths, blocks)
    row, pads = 0, []
    for b in blocks:
        N = int(lengths[b].max())
        for r, s in enumerate(b):
            assert layout.first[s] == row + r * N
            pads += range(row + r * N + int(lengths[s]), row + (r + 1) * N)
        row += len(b) * N
    assert layout.pad_rows.tolist() == pads
    assert sorted([*layout.dest.tolist(), *pads]) == list(range(layout.rows))  # every row written once
