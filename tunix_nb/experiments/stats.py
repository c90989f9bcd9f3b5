"""The statistics of a claim "A beats B": paired gains over seeds with a 95% interval, pass@k, edit similarity.

A method's gain on one seed is noise plus effect: the initialisation, the data order and
(where an experiment draws it per seed) the training data all move it. So an experiment
runs each arm over S seeds (arms that share a seed share all three), scores every prompt of
a fixed test set, and reports the mean paired gain with an interval over the seeds.

The interval is `seed_interval`: a t-interval over the seeds' values with Hall's (1992)
correction for skewness. Seed-level gains are skewed (lesson 02's five at 300 labels: 24.0,
23.0, 44.7, 23.4 and 21.6 points). On gains skewed like that, over the 1,000 draws of
tests/test_experiments.py, it covers 92.3% with 5 seeds and 93.9% with 10; the plain t
covers 91.7% and 92.7%, a percentile bootstrap over the seeds 81.3% and 88.1%. The records made
before (issue 49) held a two-level bootstrap over seeds and prompts, which covers less still
with 5 seeds: it never reaches past the seeds it has, and one outlier seed drives it.
"""

from __future__ import annotations

from math import comb
from typing import Sequence

import numpy as np
from scipy import stats as scipy_stats

CONFIDENCE = 0.95
# What every summary names as its interval
ONE_SEED = "none: one seed"
INTERVAL_METHOD = "95% t-interval over the seeds' values (each seed's mean over the test prompts), skewness-corrected (Hall 1992)"


def _hall_t_quantile_inverse(t_quantile: float, skewness: float, n: int) -> float:
    """Where the studentised mean T must lie for Hall's transform g(T) to equal `t_quantile`.

    g(T) = ((1 + a T)^3 - 1) / (3a) + skewness / (6 sqrt(n)), with a = skewness / (3 sqrt(n)):
    a monotone cubic that removes the skewness of T to first order (P. Hall, "On the removal
    of skewness by transformation", JRSS B 54(1), 1992), so g(T) is close to Student's t."""
    a = skewness / (3 * np.sqrt(n))
    shifted = t_quantile - skewness / (6 * np.sqrt(n))
    root = np.cbrt(1 + 3 * a * shifted)
    return float(3 * shifted / (root**2 + root + 1))  # (root - 1) / a, without cancelling as a -> 0


def seed_interval(per_seed) -> dict:
    """The mean of one value per seed (a paired gain, or one arm's score) with its 95% interval.

    Returns {"mean", "median", "ci95": [lo, hi], "per_seed", "seeds", "interval"}, where
    "interval" names the method. Needs 2 seeds or more; equal values give a zero-width interval.
    """
    x_S = np.asarray(per_seed, np.float64)
    if x_S.ndim != 1 or x_S.size < 2:
        raise ValueError(f"an interval over seeds needs one value for each of at least 2 seeds, got shape {x_S.shape}")
    if not np.isfinite(x_S).all():
        raise ValueError("the scores hold NaN or inf: an arm failed; look at its runs before comparing")
    n, mean, sd = x_S.size, float(x_S.mean()), float(x_S.std(ddof=1))
    se = sd / np.sqrt(n)
    if se == 0 or se <= 1e-12 * max(abs(mean), 1.0):
        lo = hi = mean
    else:
        skewness = float(np.mean((x_S - mean) ** 3)) / sd**3
        q = float(scipy_stats.t.ppf(1 - (1 - CONFIDENCE) / 2, n - 1))
        lo = mean - _hall_t_quantile_inverse(q, skewness, n) * se
        hi = mean - _hall_t_quantile_inverse(-q, skewness, n) * se
    return {"mean": mean, "median": float(np.median(x_S)), "ci95": [float(lo), float(hi)],
            "per_seed": [float(v) for v in x_S], "seeds": int(n), "interval": INTERVAL_METHOD}


def paired_gain(a_SxN, b_SxN) -> dict:
    """Mean over seeds and prompts of a - b, with `seed_interval`'s 95% interval.

    `a_SxN`, `b_SxN`: the two arms' scores, seed s (the same initialisation and data order
    in both arms) by test prompt n (the same prompts in both). Each seed's gain is its mean
    difference over the prompts; the interval is over those S gains. The test prompts are
    fixed, so the interval speaks for a new seed on these prompts, not for new prompts.
    Returns `seed_interval`'s dict with "prompts": N added; with one seed (a pilot), no
    interval: "ci95" is None.
    """
    a_SxN, b_SxN = np.asarray(a_SxN, np.float64), np.asarray(b_SxN, np.float64)
    if a_SxN.ndim != 2 or a_SxN.size == 0 or a_SxN.shape != b_SxN.shape:
        raise ValueError(f"a and b must be [seeds, prompts] arrays of one shape, got {a_SxN.shape} and {b_SxN.shape}")
    d_SxN = a_SxN - b_SxN
    if not np.isfinite(d_SxN).all():
        raise ValueError("the scores hold NaN or inf: an arm failed; look at its runs before comparing")
    gain_S = d_SxN.mean(axis=1)
    if gain_S.size == 1:
        one = float(gain_S[0])
        return {"mean": one, "median": one, "ci95": None, "per_seed": [one], "seeds": 1,
                "interval": ONE_SEED, "prompts": int(d_SxN.shape[1])}
    return {**seed_interval(gain_S), "prompts": int(d_SxN.shape[1])}


def mean_interval(scores_SxN) -> dict:
    """One arm's mean score with the same interval as `paired_gain` (over its seeds' means)."""
    scores_SxN = np.asarray(scores_SxN, np.float64)
    return paired_gain(scores_SxN, np.zeros_like(scores_SxN))


def describe_gain(gain: dict, *, scale: float = 100, decimals: int = 1, unit: str = "points") -> str:
    """A gain as the lessons quote it: "+30.1 points (95% interval +27.0 to +33.2)".

    `scale` 100 turns a share into points; the lessons' prose and the README print this
    string, and a test checks that what they quote is what the stored record gives."""
    f = lambda x: f"{scale * x:+.{decimals}f}"  # noqa: E731
    if gain["ci95"] is None:
        return f"{f(gain['mean'])} {unit} (one seed, no interval)".replace("  ", " ")
    return f"{f(gain['mean'])} {unit} (95% interval {f(gain['ci95'][0])} to {f(gain['ci95'][1])})".replace("  ", " ")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt from n samples of which c are right (Chen et al.,
    2021): 1 - C(n - c, k) / C(n, k), the chance that k samples drawn without replacement
    from the n hold at least one right answer."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_at_k_curve(correct_NxM, ks: Sequence[int]) -> np.ndarray:
    """[len(ks), N]: pass@k of every prompt, from its M samples' correctness (a bool [N, M])."""
    correct_NxM = np.asarray(correct_NxM, bool)
    m = correct_NxM.shape[1]
    c_N = correct_NxM.sum(axis=1)
    return np.array([[pass_at_k(m, int(c), k) for c in c_N] for k in ks])


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions from a to b."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def edit_similarity(prediction: str, reference: str) -> float:
    """1 - edit distance / the longer length: 1 for an exact match, 0 for nothing in common.
    Unlike exact match it sees how much of a long answer is right, so it counts errors made
    after the model's own wrong prefix."""
    longest = max(len(prediction), len(reference))
    return 1.0 if longest == 0 else 1.0 - edit_distance(prediction, reference) / longest


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties share their mean
    rank). 1 when y rises with x, whatever the shape of the rise; it asks whether two figures
    move together across runs without assuming a straight line between them."""
    if len(xs) != len(ys) or len(xs) < 3:
        raise ValueError(f"rank_correlation needs two sequences of the same length, at least 3; got {len(xs)} and {len(ys)}.")
    return float(np.corrcoef(_ranks(xs), _ranks(ys))[0, 1])


def _ranks(values: Sequence[float]) -> np.ndarray:
    # equal figures summed in different orders differ in their last bits: round so they tie
    values = np.round(np.asarray(values, dtype=float), 12)
    order = values.argsort(kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    for value in np.unique(values):  # ties: their mean rank
        ranks[values == value] = ranks[values == value].mean()
    return ranks
