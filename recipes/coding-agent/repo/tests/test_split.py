import unittest

from ledger import split


class SplitTest(unittest.TestCase):
    def test_even_split(self) -> None:
        self.assertEqual(split(300, 3), [100, 100, 100])

    def test_shares_sum_to_the_total(self) -> None:
        for total, parts in ((100, 3), (1000, 7), (5, 4)):
            self.assertEqual(sum(split(total, parts)), total, (total, parts))

    def test_shares_differ_by_at_most_one_cent(self) -> None:
        for total, parts in ((100, 3), (1000, 7), (5, 4)):
            shares = split(total, parts)
            self.assertLessEqual(max(shares) - min(shares), 1, (total, parts, shares))

    def test_zero_parts_is_refused(self) -> None:
        with self.assertRaises(ValueError):
            split(100, 0)


if __name__ == "__main__":
    unittest.main()
