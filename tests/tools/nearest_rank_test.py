#!/usr/bin/python3
"""bench/nearest_rank.py: the spec's nearest-rank quantile (0x0DA), Q_q = x_(ceil(q n))."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from nearest_rank import median, quantile  # noqa: E402


class NearestRankTest(unittest.TestCase):
    def test_the_spec_results(self):
        # Twenty values of our own that give 0x0DA's results: p50 = 11, p95 = 23, max 24.
        v = [24, 3, 11, 7, 23, 1, 18, 12, 5, 15, 2, 9, 20, 13, 4, 17, 6, 8, 14, 16]
        self.assertEqual(quantile(v, 0.5), 11)
        self.assertEqual(quantile(v, 0.95), 23)
        self.assertEqual(quantile(v, 1.0), 24)
        self.assertEqual(quantile(v, 0.0), 1)  # rank clamps to 1

    def test_median_is_the_lower_middle_and_no_interpolation(self):
        self.assertEqual(median([4, 1, 3, 2]), 2)
        self.assertEqual(median([3, 1, 2]), 2)
        self.assertEqual(quantile(list(range(300)), 0.9), 269)  # x_(270)

    def test_a_rank_within_rounding_is_that_rank(self):
        self.assertEqual(quantile(list(range(1, 101)), 0.07), 7)  # 0.07 * 100 = 7.000000000000001
        with self.assertRaises(ValueError):
            quantile([], 0.5)


if __name__ == "__main__":
    unittest.main()
