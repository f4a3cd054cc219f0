"""Which sequences of a batch share a padded call, or a packed row (no torch).

A padded call costs about ``overhead + rows * longest`` positions of work: every row is padded to the
longest, and each call has a fixed cost (on a CPU, mostly streaming the weights once, worth a few dozen
positions). Random short texts padded to their longest waste a third of the work or more: cutting the
length-sorted batch where that saves more than a call costs keeps most of the saving, and packing
several sequences into each row (an encoder that allows it) keeps nearly all of it."""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def length_groups(lengths: Sequence[int], overhead: int, budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in groups, each run as one padded call, that minimise the padded positions
    plus ``overhead`` per call, with each group's padded size ``len(group) * max(length)`` at most
    ``budget`` (a sequence longer than that alone).

    Groups are sorted by length, shortest first, and within each group shortest first.

    Exact by dynamic programming over the length-sorted order (an optimal grouping never interleaves
    lengths): ``best[j]`` is the cheapest cost of the ``j`` shortest, the last group being
    ``order[i:j]`` padded to ``lengths[order[j - 1]]``, over the cuts an optimal grouping needs (see
    :func:`_run_groups` and :func:`_budget_groups`).
    """
    order = sorted(range(len(lengths)), key=lambda k: lengths[k])
    ordered = [lengths[k] for k in order]
    if order and len(order) * ordered[-1] <= budget:
        return _run_groups(ordered, order, overhead)
    return _budget_groups(ordered, order, overhead, budget)


def _run_ends(ordered: list[int]) -> list[int]:
    """Where each run of equal lengths of the sorted ``ordered`` ends (exclusive)."""
    n = len(ordered)
    return [j for j in range(1, n + 1) if j == n or ordered[j] != ordered[j - 1]]


def _budget_groups(ordered: list[int], order: list[int], overhead: int, budget: int) -> list[list[int]]:
    """:func:`length_groups` where the budget cuts (``ordered``: the lengths in ``order``). An optimal grouping then
    cuts inside a run of equal lengths only after a full group (one more sequence of the run would exceed the
    budget): where the group before such a cut has room, the run's next sequence moved into it costs no more (its
    row of the same length, against a row of at least that length, or a whole call, in the group after). So the
    dynamic program's cuts are the runs' ends and, from each cut, the end of the fullest group starting there: a
    few dozen for a batch of hundreds of tweets, each tried against the runs' ends within the budget."""
    n = len(ordered)
    ends = _run_ends(ordered)
    best, cut = {0: 0}, {0: 0}
    todo, seen = [0], {0}
    while todo:
        i = heapq.heappop(todo)  # every cut before it is done: its cost is final
        if i == n:
            break
        lo, hi = i + 1, n  # the fullest group from i ends at the largest j within the budget (at least one sequence)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if (mid - i) * ordered[mid - 1] <= budget else (lo, mid - 1)
        for j in itertools.chain((e for e in itertools.islice(ends, bisect.bisect_right(ends, i), None) if e < lo),
                                 (lo,)):
            cost = best[i] + overhead + (j - i) * ordered[j - 1]
            if j not in best or cost < best[j]:
                best[j], cut[j] = cost, i
            if j not in seen:
                seen.add(j)
                heapq.heappush(todo, j)
    return _cut(order, cut)


def _run_groups(ordered: list[int], order: list[int], overhead: int) -> list[list[int]]:
    """:func:`length_groups` where the budget cannot cut (every sequence fits in one group; ``ordered``: the lengths
    in ``order``): then an optimal grouping never cuts inside a run of equal lengths (the later group's sequences
    of the run moved into the earlier one cost no more), so the dynamic program runs over the distinct lengths,
    not the sequences (a batch of 512 tweets has a few dozen)."""
    ends = _run_ends(ordered)
    best = {0: 0}
    cut = {0: 0}
    for m, j in enumerate(ends):
        longest = ordered[j - 1]
        best[j], cut[j] = min((best[i] + overhead + (j - i) * longest, -i) for i in [0, *ends[:m]])
        cut[j] = -cut[j]
    return _cut(order, cut)


def _cut(order: list[int], cut: Sequence[int] | dict[int, int]) -> list[list[int]]:
    """The groups the dynamic program chose, first to last: the last one is ``order[cut[n]:n]``, and so on back."""
    groups: list[list[int]] = []
    j = len(order)
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


def pack_rows(lengths: Sequence[int], limit: int, width: int) -> tuple[int, list[list[int]]]:
    """Indices of ``lengths`` packed into rows of one length ``L`` (best fit, longest first): ``L`` and
    the rows. ``L`` is the longest length or up to twice it (at most ``limit``), whichever costs least.

    A longer row leaves less room unused at the rows' ends but costs more attention per position: in a
    transformer of ``width`` d, attention over ``L`` positions costs ``4 L d`` FLOPs a position against
    ``24 d^2`` for its projections and feed-forward, so a row costs ``L * (1 + L / (6 d))``.

    Best fit (each sequence to the row with the least room that holds it, rows kept by their room) packs as
    tightly as first fit (the same rows on batches of test tweets) without looking through the rows for each
    sequence (256 tweets: 0.15-0.3 ms against 1.7), and a length whose rows, even full, would cost no less than
    the best so far is not tried.
    """
    if not lengths:
        return 0, []
    longest, total = max(lengths), sum(lengths)
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    best: tuple[float, int, list[list[int]]] | None = None
    for L in sorted({min(max(longest, int(longest * m)), max(limit, longest)) for m in (1, 1.25, 1.5, 2)}):
        if best is not None and -(-total // L) * L * (1 + L / (6 * width)) >= best[0]:
            continue  # even rows filled to the last slot would cost no less
        rows: list[list[int]] = []
        by_room: list[list[int]] = [[] for _ in range(L + 1)]  # room -> the rows with that much room
        for k in order:
            need = room = lengths[k]
            while room <= L and not by_room[room]:
                room += 1
            if room > L:  # none holds it: a new row
                rows.append([])
                r, room = len(rows) - 1, L
            else:
                r = by_room[room].pop()
            rows[r].append(k)
            by_room[room - need].append(r)
        cost = len(rows) * L * (1 + L / (6 * width))
        if best is None or cost < best[0]:
            best = (cost, L, rows)
    assert best is not None
    return best[1], best[2]


@dataclass(frozen=True)
class Layout:
    """Where the tokens of sequences that lie back to back in a stream are written (see :func:`lay_out`).

    Attributes:
        rows: rows in all.
        dest: ``[T]`` each token's row.
        first: ``[s]`` each sequence's first row (its tokens are rows ``first .. first + length``).
        blocks: per block, ``(first row, sequences, padded length N)``: rows ``first .. first + sequences * N``
            are its sequences padded to ``N``, one after another.
        pad_rows: ``[P]`` the blocks' padding rows.
    """

    rows: int
    dest: np.ndarray
    first: np.ndarray
    blocks: list[tuple[int, int, int]]
    pad_rows: np.ndarray


def run_rows(first: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``[T]`` the rows of runs that start at ``first [s]`` and are ``lengths [s]`` long, run after run (``T`` their
    total; numpy, no loop over runs)."""
    return np.repeat(first - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))  # [T]


def lay_out(lengths: np.ndarray, blocks: Sequence[Sequence[int]]) -> Layout:
    """Rows for sequences of ``lengths [s]``: the sequences of each block (indices; no sequence in two) padded to the
    block's longest, one after another, block after block, then every other sequence, back to back. A reader of a
    block then finds it as ``[b, N]`` rows without a copy (numpy; no loop over sequences or tokens)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    first = np.full(len(lengths), -1, dtype=np.int64)  # [s]
    sizes = np.fromiter(map(len, blocks), dtype=np.int64, count=len(blocks))  # [k] sequences a block
    seq = np.fromiter(itertools.chain.from_iterable(blocks), dtype=np.int64, count=int(sizes.sum()))  # [q] in blocks
    spans: list[tuple[int, int, int]] = []
    pad_rows = np.empty(0, dtype=np.int64)  # [P]
    row = 0
    if len(seq):
        assert sizes.all(), "an empty block"
        n = lengths[seq]  # [q]
        begin = np.cumsum(sizes) - sizes  # [k] each block's first in seq
        N = np.maximum.reduceat(n, begin)  # [k] each block's longest
        size = sizes * N  # [k] rows of each block
        block_first = np.cumsum(size) - size  # [k]
        which = np.repeat(np.arange(len(sizes)), sizes)  # [q] each one's block
        starts = block_first[which] + (np.arange(len(seq)) - begin[which]) * N[which]  # [q] each one's first row
        assert (first[seq] < 0).all(), "a sequence in two places"
        first[seq] = starts
        assert (first[seq] == starts).all(), "a sequence in two places"
        empty = N[which] - n  # [q] padding rows after each
        offset = np.arange(int(empty.sum())) - np.repeat(np.cumsum(empty) - empty, empty)  # [P] each within its run
        pad_rows = np.repeat(starts + n, empty) + offset  # [P]
        spans = list(zip(block_first.tolist(), sizes.tolist(), N.tolist(), strict=True))
        row = int(size.sum())
    rest = np.flatnonzero(first < 0)  # [r]
    first[rest] = row + np.cumsum(lengths[rest]) - lengths[rest]
    rows = row + int(lengths[rest].sum())
    return Layout(rows, run_rows(first, lengths), first, spans, pad_rows)
