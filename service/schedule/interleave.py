"""Ordering batches across buckets, epochs and ranks (guarantees 3 and 4).

The single-stream order (``interleave_1d``) is built by peeling buckets from the
smallest to the largest: each larger bucket is merged into the order of the
smaller ones, either in even groups between their items (when it outnumbers
them) or one item per gap (when it does not), where gaps between two equal
neighbours are filled first. The result meets the lower bound on runs for every
bucket (the largest one's runs are ``ceil(n / (N - n + 1))``, every other
bucket never repeats back to back) and keeps each running share within about
one item. Used for one rank, for the step sequence of ``sync`` mode, and as the
reference order elsewhere.

Dealing one interleaved sequence to several ranks round-robin aliases with its
period (an alternating order dealt to two ranks gives each rank one bucket), so
``mixed`` mode builds the whole step-by-rank grid at once (``interleave_grid``):
a smooth weighted round-robin in two dimensions, where every cell picks the
bucket that is furthest behind both in its rank's own stream and in the job as
a whole, without exceeding a bucket's run bound on that rank. It costs a few
microseconds a batch in pure Python, the price of keeping every rank's stream
and every step proportional at the same time.

The end of the epoch needs more than that rule: the last cells get whatever is
left, so a rank could be dealt the bucket it has just had and end its stream
on a run over its bound. In the last ``END_STEPS`` steps every cell therefore
looks ahead. For each bucket, the most batches the ranks can still hold
without a run over the bucket's cap (``_room`` per rank, summed) is compared
with the batches left; when a bucket has no room to spare, the next rank that
would lose room by skipping it takes it now. A stream can hold a mix of
batches exactly when no bucket's count exceeds its ``_room`` (checked
exhaustively on small cases in the tests), so while every bucket has room the
epoch can be finished without a run over a cap, and the lookahead keeps it
that way. The last step, whose batches are fixed by then, is dealt again if
the rule's dealing ends a rank on a run over its own bound: exchanges between
ranks (the step's buckets stay the same) minimise runs over both the cap and
the rank's own bound, then run excess, then share deviations above the
largest of the rule's dealing, then the number of changed cells. Looking
ahead over the whole epoch would keep every run within its cap, but where the
counts leave no room it would do so by moving buckets between steps from the
start; over the last steps only, the rest of the epoch stays as it was.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

try:  # the compiled grid interleaver; optional, same results
    from . import _grid as _grid_c  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised where no compiler was available
    _grid_c = None

# Scores stay exact in int64 below this many batches (they reach ~4 * total**2).
_C_LIMIT = 1_000_000_000

# The steps at the end of an epoch in which every cell looks ahead (see above): enough for
# every end-of-stream run found on the production mix and on real-text lengths (3 were
# needed); from about 6 on it starts to cost distinct buckets per step on random counts.
END_STEPS = 4

__all__ = [
    "END_STEPS",
    "interleave_1d",
    "interleave_grid",
    "run_lower_bound",
]

IntArray = npt.NDArray[np.int64]


def run_lower_bound(counts: npt.ArrayLike) -> IntArray:
    """The shortest possible longest run per bucket: ``ceil(n / (N - n + 1))`` (0 if n = 0)."""
    c = np.asarray(counts, dtype=np.int64)
    total = int(c.sum())
    bound = -(-c // np.maximum(total - c + 1, 1))
    return np.where(c > 0, bound, 0).astype(np.int64)


def _merge(bucket: int, n: int, others: IntArray) -> IntArray:
    """Merge ``n`` items of ``bucket`` (at least as many as any bucket in ``others``)."""
    m = len(others)
    out = np.full(n + m, bucket, dtype=np.int64)
    if m == 0:
        return out
    if n > m:
        # m + 1 non-empty groups of `bucket`, sizes as even as possible, with
        # every item of `others` alone between two groups.
        edges = (np.arange(m + 2, dtype=np.int64) * n + (m + 1) // 2) // (m + 1)
        edges[0], edges[-1] = 0, n
        pos_others = np.cumsum(np.diff(edges))[:-1] + np.arange(m)
        out[pos_others] = others
        return out
    if n == m:
        out[1::2] = others
        return out
    # n < m: one item of `bucket` in n of the m + 1 gaps of `others`. A gap
    # between two equal neighbours must be filled (only the previous largest
    # bucket can have them, and there are fewer of them than n); the rest of
    # the items are spread evenly over the remaining gaps.
    gaps = np.zeros(m + 1, dtype=bool)
    gaps[1:m] = others[1:] == others[:-1]
    forced = int(gaps.sum())
    if forced > n:  # cannot happen for the peeling order; kept as a guard
        raise AssertionError("interleave: more forced gaps than items")
    free = np.flatnonzero(~gaps)
    extra = n - forced
    if extra:
        pick = (np.arange(extra, dtype=np.int64) * 2 + 1) * len(free) // (2 * extra)
        gaps[free[pick]] = True
    before = np.cumsum(gaps)[:m]
    out[np.arange(m) + before] = others
    return out


def interleave_1d(counts: npt.ArrayLike) -> IntArray:
    """One stream holding ``counts[b]`` items of each bucket ``b``, in interleaved order."""
    c = np.asarray(counts, dtype=np.int64)
    order = np.lexsort((np.arange(len(c)), c))  # smallest count first, ties by bucket id
    seq = np.empty(0, dtype=np.int64)
    for b in order:
        if c[b] > 0:
            seq = _merge(int(b), int(c[b]), seq)
    return seq


def interleave_grid(counts: npt.ArrayLike, world_size: int) -> IntArray:
    """A ``[steps, world_size]`` grid of buckets for ``mixed`` mode.

    ``sum(counts)`` must be a multiple of ``world_size``. Every cell takes the
    bucket with the largest combined lag (behind its share in this rank's
    stream, and behind its share of the whole job so far), skipping a bucket
    that would exceed its run bound on this rank; ranks take turns starting a
    step so no rank is favoured. In the last ``END_STEPS`` steps a bucket that
    the rest of the epoch has no room to spare for is taken first, and the last
    step is dealt again if a rank would end on a run over its own bound (module
    docstring). Runs in C when the extension is built, with the same integer
    arithmetic as the pure Python version.
    """
    c = [int(x) for x in np.asarray(counts, dtype=np.int64)]
    total = sum(c)
    if total % world_size:
        raise ValueError("interleave_grid: total batches must be a multiple of world_size")
    if world_size == 1:
        return interleave_1d(c).reshape(-1, 1)
    if total < _C_LIMIT:
        grid = _grid_compiled(c, world_size)
        if grid is not None:
            return grid
    return _grid_python(c, world_size)


def _grid_compiled(c: list[int], world_size: int, end_steps: int = END_STEPS) -> IntArray | None:
    """``interleave_grid`` from the compiled interleaver; None where it is not built."""
    if _grid_c is None:
        return None
    try:
        cells = np.frombuffer(_grid_c.grid(c, world_size, end_steps), dtype=np.int64)
    except TypeError:  # an extension built from an older _grid.c, whose grid is not this one
        return None
    return cells.reshape(-1, world_size).copy()


def _room(length: int, cap: int, run: int) -> int:
    """The most batches of one bucket that fit in ``length`` cells of a stream with runs of at
    most ``cap``, when the stream already ends in a run of ``run`` of them (0 if it does not)."""
    free = cap - run
    if length <= free:
        return length
    return length - (length - free + cap) // (cap + 1)


def _grid_python(c: list[int], world_size: int, end_steps: int = END_STEPS) -> IntArray:
    """``interleave_grid`` in pure Python; ``end_steps`` = 0 turns the end-of-epoch lookahead off."""
    total = sum(c)
    steps = total // world_size
    nb = len(c)
    live = [b for b in range(nb) if c[b] > 0]
    per_rank = [-(-x // world_size) for x in c]
    cap = [max(1, -(-n // max(1, steps - n + 1))) for n in per_rank]
    # Scores are lags scaled by 2 * total so they are exact integers:
    #   rank lag  (t + 1) * c_b / total - count_rb
    #   job lag   (done * c_b / total - count_b) / 2   (weight 1/2 found best for
    #   both every rank's smoothness and the steps' on the production mix)
    remaining = list(c)
    rank_count = [[0] * nb for _ in range(world_size)]
    job_count = [0] * nb
    last = [-1] * world_size
    run = [0] * world_size
    grid = np.empty((steps, world_size), dtype=np.int64)
    veto = 4 * total * total + 1  # larger than any score difference
    # The end-of-epoch lookahead. room_b, the most batches of b the ranks can still take, is
    #   (ranks yet to play this step) * _room(left, cap_b, 0) + (the others) * _room(left - 1, cap_b, 0)
    #   + adj[b],
    # where adj[b] corrects for the ranks whose stream ends in a run of b. It drops by at most
    # one a cell, so after finding the least spare room s, the next s cells need no check.
    first = max(0, steps - end_steps)
    adj = [0] * nb
    spare = [0] * nb
    prev_last = list(last)
    prev_run = list(run)
    for t in range(steps):
        row = [0] * world_size
        base = t * world_size
        left = steps - t  # cells of a rank's stream from this step on
        look = t >= first and left > 1
        if t == first and look:
            for q in range(world_size):
                if last[q] >= 0:
                    k = cap[last[q]]
                    adj[last[q]] += _room(left, k, run[q]) - _room(left, k, 0)
        if left == 1:
            prev_last = list(last)
            prev_run = list(run)
        unchecked = 0
        for i in range(world_size):
            r = (i + t) % world_size
            counts_r = rank_count[r]
            last_r = last[r]
            done = base + i + 1
            best = -1
            if look:
                if unchecked > 0:
                    unchecked -= 1
                else:
                    least = total  # more than any spare room
                    for b in live:
                        k = cap[b]
                        s = (
                            (world_size - i) * _room(left, k, 0)
                            + i * _room(left - 1, k, 0)
                            + adj[b]
                            - remaining[b]
                        )
                        spare[b] = s
                        least = min(least, s)
                    if least > 0:
                        unchecked = least - 1
                    else:  # a bucket with no room to spare: this rank takes it if skipping it loses room
                        for b in live:
                            if spare[b] <= 0 and remaining[b] > 0:
                                k = cap[b]
                                if _room(left, k, run[r] if b == last_r else 0) > _room(left - 1, k, 0):
                                    best = b
                                    break
            if best < 0:
                best_score = 0
                for b in live:
                    if remaining[b] == 0:
                        continue
                    cb = c[b]
                    score = (2 * (t + 1) + done) * cb - (2 * counts_r[b] + job_count[b]) * total
                    if b == last_r and run[r] >= cap[b]:
                        score -= veto
                    if best < 0 or score > best_score:
                        best_score = score
                        best = b
            if look and last_r >= 0:
                k = cap[last_r]
                adj[last_r] -= _room(left, k, run[r]) - _room(left, k, 0)
            remaining[best] -= 1
            counts_r[best] += 1
            job_count[best] += 1
            if best == last_r:
                run[r] += 1
            else:
                last[r] = best
                run[r] = 1
            if look:
                k = cap[best]
                adj[best] += _room(left - 1, k, run[r]) - _room(left - 1, k, 0)
            row[r] = best
        grid[t] = row
    if steps and end_steps > 0:
        _redeal_last_step(grid, live, cap, rank_count, prev_last, prev_run)
    return grid


def _bound(n: int, length: int) -> int:
    return -(-n // (length - n + 1)) if n > 0 else 0


def _redeal_last_step(
    grid: IntArray,
    live: list[int],
    cap: list[int],
    rank_count: list[list[int]],
    prev_last: list[int],
    prev_run: list[int],
) -> None:
    """Deal the last step's batches again if the rule gave a rank a run over its own bound.

    Each (rank, bucket) gets a cost, compared in this order: how far the rank's last run
    would pass both ``cap`` and its own bound (none, when the lookahead left room), the
    rank's largest run excess over its own bounds, whether its share deviation would pass
    the largest of the rule's dealing, whether it moves. Negative cycles of exchanges
    between ranks are cancelled until none is left, which gives the least total cost; the
    step's buckets stay the same.
    """
    steps, world = grid.shape
    row = grid[steps - 1]
    greedy = [int(x) for x in row]
    over = False
    for r in range(world):
        z = greedy[r]
        end_run = prev_run[r] + 1 if z == prev_last[r] else 1
        if end_run > _bound(rank_count[r][z], steps):
            over = True
            break
    if not over:
        return
    types = [b for b in live if b in greedy]
    nt = len(types)
    # excess[r][j], dev[r][j]: rank r's largest run excess and share deviation (times steps)
    # when it takes types[j] last
    beyond = [[0] * nt for _ in range(world)]
    excess = [[0] * nt for _ in range(world)]
    dev = [[0] * nt for _ in range(world)]
    for r in range(world):
        pre = list(rank_count[r])
        pre[greedy[r]] -= 1
        longest, dev0, dev1 = _stream_tables(grid[: steps - 1, r], steps, pre, len(pre))
        exc0 = [max(0, longest[b] - _bound(pre[b], steps)) for b in range(len(pre))]
        for j, z in enumerate(types):
            end_run = prev_run[r] + 1 if z == prev_last[r] else 1
            own = _bound(pre[z] + 1, steps)
            beyond[r][j] = max(0, end_run - max(cap[z], own))
            e = max(0, max(longest[z], end_run) - own)
            d = dev1[z]
            for b in live:
                if b != z:
                    e = max(e, exc0[b])
                    d = max(d, dev0[b])
            excess[r][j] = e
            dev[r][j] = d
    index = {z: j for j, z in enumerate(types)}
    held = [index[z] for z in greedy]
    theta = max(dev[r][held[r]] for r in range(world))

    def cost(r: int, j: int) -> tuple[int, int, int, int]:
        return (
            beyond[r][j],
            excess[r][j],
            1 if dev[r][j] > theta else 0,
            0 if types[j] == greedy[r] else 1,
        )

    while True:
        # edge a -> b: the cheapest change of a rank now holding types[a] to types[b]
        weight: list[list[tuple[int, int, int, int] | None]] = [[None] * nt for _ in range(nt)]
        mover = [[-1] * nt for _ in range(nt)]
        for r in range(world):
            a = held[r]
            ca = cost(r, a)
            for b in range(nt):
                if b == a:
                    continue
                cb = cost(r, b)
                change = (cb[0] - ca[0], cb[1] - ca[1], cb[2] - ca[2], cb[3] - ca[3])
                known = weight[a][b]
                if known is None or change < known:
                    weight[a][b] = change
                    mover[a][b] = r
        dist = [(0, 0, 0, 0)] * nt
        pred = [-1] * nt
        hit = -1
        for _ in range(nt):
            hit = -1
            for a in range(nt):
                for b in range(nt):
                    edge = weight[a][b]
                    if edge is None:
                        continue
                    da = dist[a]
                    nd = (da[0] + edge[0], da[1] + edge[1], da[2] + edge[2], da[3] + edge[3])
                    if nd < dist[b]:
                        dist[b] = nd
                        pred[b] = a
                        hit = b
            if hit < 0:
                break
        if hit < 0:
            break
        x = hit
        for _ in range(nt):
            x = pred[x]
        cycle = [x]
        y = pred[x]
        while y != x:
            cycle.append(y)
            y = pred[y]
        cycle.reverse()  # edges cycle[i] -> cycle[i + 1]
        n = len(cycle)
        gain = (0, 0, 0, 0)
        for i in range(n):
            edge = weight[cycle[i]][cycle[(i + 1) % n]]
            assert edge is not None
            gain = (gain[0] + edge[0], gain[1] + edge[1], gain[2] + edge[2], gain[3] + edge[3])
        if gain >= (0, 0, 0, 0):  # cannot happen (cycles of the predecessor graph are negative)
            break
        moves = [(mover[cycle[i]][cycle[(i + 1) % n]], cycle[(i + 1) % n]) for i in range(n)]
        for r, b in moves:
            held[r] = b
    for r in range(world):
        z = types[held[r]]
        if z != greedy[r]:
            rank_count[r][greedy[r]] -= 1
            rank_count[r][z] += 1
            row[r] = z


def _stream_tables(
    col: IntArray, steps: int, pre: list[int], nb: int
) -> tuple[list[int], list[int], list[int]]:
    """For one rank's stream but its last cell: the longest run of each bucket, and its share
    deviation times ``steps`` (max over prefixes of ``|steps * count - prefix * n|``) for a
    final count n of ``pre[b]`` and of ``pre[b] + 1``.

    The extremes of ``steps * count - prefix * n`` lie just after an item of the bucket
    (highs) or just before one and at the end (lows), so each item is looked at once.
    """
    m = len(col)
    runs = np.zeros(nb, dtype=np.int64)
    if m:
        starts = np.r_[0, np.flatnonzero(col[1:] != col[:-1]) + 1]
        np.maximum.at(runs, col[starts], np.diff(np.r_[starts, m]))
    longest = [int(x) for x in runs]
    dev0 = [0] * nb
    dev1 = [0] * nb
    for b in range(nb):
        pos = np.flatnonzero(col == b).astype(np.int64)
        i = np.arange(1, len(pos) + 1, dtype=np.int64)
        for extra, out in ((0, dev0), (1, dev1)):
            n = pre[b] + extra
            best = 0
            if m:
                best = abs(steps * len(pos) - m * n)  # the prefix of every cell but the last
            if len(pos):
                best = max(best, int(np.abs(steps * i - (pos + 1) * n).max()))
                after = pos >= 1
                if after.any():
                    best = max(best, int(np.abs(steps * (i[after] - 1) - pos[after] * n).max()))
            out[b] = best
    return longest, dev0, dev1
