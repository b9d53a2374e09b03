"""The benches' one quantile convention, the spec's (0x0DA): nearest rank, Q_q = x_(ceil(q n)) of
the n observations in ascending order, no interpolation; the median is Q_0.5, the lower of the two
middle values for an even count. The C++ side is runtime/quantile.h."""

import math


def rank_index(n, q):
    """The 1-based nearest rank ceil(q n) in [1, n]; q n within rounding of an integer is it."""
    x = q * n
    if abs(x - round(x)) <= 1e-9 * max(1.0, abs(x)):
        x = round(x)
    return min(n, max(1, math.ceil(x)))


def quantile(values, q):
    v = sorted(values)
    if not v:
        raise ValueError("quantile of no values")
    return v[rank_index(len(v), q) - 1]


def median(values):
    return quantile(values, 0.5)
