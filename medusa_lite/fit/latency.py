"""The latency model: context-length buckets and a verify forward's seconds as a function of tree tokens and cache
length, interpolated from measured points. Pure: numbers in, numbers out."""

from __future__ import annotations

from ..decode.adaptive import BUCKETS, bucket_of  # noqa: F401 - the buckets decoding's guards read (home: decode)


def bucket_contexts(buckets=BUCKETS) -> list[float]:
    """The cache length each bucket's latency is read at: its middle; twice its start for the open last one."""
    bounds = list(buckets[1:])
    return [(lo + hi) / 2 for lo, hi in zip(buckets, bounds)] + [max(2.0 * buckets[-1], 128.0)]


def interpolate_latency(table: dict[int, float], tokens: int) -> float:
    """Forward latency (seconds) for ``tokens`` new tokens from a measured ``{tokens: seconds}`` table.

    Piecewise linear between measured points; flat below the smallest; beyond the largest, extended
    with the slope of the last two points (never decreasing).
    """
    if not table:
        raise ValueError("empty latency table")
    xs = sorted(table)
    if tokens in table:
        return float(table[tokens])
    if tokens <= xs[0]:
        return float(table[xs[0]])
    if tokens >= xs[-1]:
        if len(xs) == 1:
            return float(table[xs[-1]])
        x0, x1 = xs[-2], xs[-1]
        slope = max((table[x1] - table[x0]) / (x1 - x0), 0.0)
        return float(table[x1] + slope * (tokens - x1))
    for x0, x1 in zip(xs, xs[1:]):
        if x0 <= tokens <= x1:
            w = (tokens - x0) / (x1 - x0)
            return float(table[x0] * (1 - w) + table[x1] * w)
    raise AssertionError("unreachable")


def monotone_latency(table: dict[int, float]) -> dict[int, float]:
    """Remove timing noise that makes a bigger forward look cheaper: latency(n) = min over m >= n of table[m]."""
    out, best = {}, float("inf")
    for n in sorted(table, reverse=True):
        best = min(best, float(table[n]))
        out[n] = best
    return dict(sorted(out.items()))


def latency_at(latency: dict[int, dict[int, float]], tokens: float, context: float) -> float:
    """Seconds of one verify forward of ``tokens`` tree tokens over a cache of ``context`` tokens.

    latency: ``{cache_len: {tokens: seconds}}`` as measured. Within one cache length: piecewise linear in
    tokens (made non-decreasing, flat below the smallest point, extended by the last slope above the
    largest); across cache lengths: linear in the cache length (attention grows with it), never below the
    smallest measured cache length's value and never decreasing with context.
    """
    if not latency:
        raise ValueError("empty latency table")
    at, highest = {}, 0.0
    for c, table in sorted(latency.items()):  # never decreasing with context: a running maximum
        highest = max(highest, interpolate_latency(monotone_latency(table), tokens))
        at[c] = highest
    lengths = sorted(at)
    if len(lengths) == 1 or context <= lengths[0]:
        return at[lengths[0]]
    lo, hi = (lengths[-2], lengths[-1]) if context >= lengths[-1] else next(
        (a, b) for a, b in zip(lengths, lengths[1:]) if a <= context <= b)
    slope = max((at[hi] - at[lo]) / (hi - lo), 0.0)
    return at[lo] + slope * (context - lo)


def max_tokens(latency: dict[int, dict[int, float]]) -> int:
    """The largest number of tree tokens measured at the shortest cache length, which the probe measures at every
    size (longer cache lengths at a few sizes, extrapolated in tokens); no candidate beyond it is priced."""
    return max(latency[min(latency)])
