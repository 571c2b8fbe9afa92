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
