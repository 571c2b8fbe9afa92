"""Small shared helpers for the tests."""

import numpy as np
import scipy.stats


def chi_square_pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of a chi-square goodness-of-fit test of `counts` against `expected_probs`
    (categories with zero expected probability must have zero counts: checked separately)."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(expected_probs, dtype=np.float64)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a category of zero probability was sampled"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return float(scipy.stats.chisquare(counts[keep], expected).pvalue)


class ReferenceRing:
    """A NumPy reference model of the ring: every step ever added, per row, by absolute time.

    Values are chosen unique per (row, time) by the tests, so comparing a sampled window with
    `window(row, start)` checks both the data and its place.
    """

    def __init__(self, rows: int, length: int, sequence_length: int, period: int):
        self.rows, self.length = rows, length
        self.sequence_length, self.period = sequence_length, period
        self.steps: list[np.ndarray] = []  # each (rows, *leaf)

    @property
    def total(self) -> int:
        return len(self.steps)

    @property
    def fill(self) -> int:
        return min(self.total, self.length)

    def add(self, batch: np.ndarray) -> None:
        """`batch` shaped (rows, T, *leaf)."""
        for t in range(batch.shape[1]):
            self.steps.append(np.asarray(batch[:, t]))

    def valid_starts(self) -> list[int]:
        """Absolute start steps of every valid window (the same for each row)."""
        oldest = self.total - self.fill
        last = self.total - self.sequence_length
        return [t for t in range(oldest, last + 1) if t % self.period == 0]

    def window(self, row: int, start: int) -> np.ndarray:
        return np.stack([self.steps[t][row] for t in range(start, start + self.sequence_length)])
