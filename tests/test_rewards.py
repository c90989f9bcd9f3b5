"""Tests for tunix_nb.rewards: hand-computed rewards, the weighted sum, metrics and errors."""

import sys

import numpy as np
import pytest

from tunix_nb import data, rewards

PROMPTS = ["add 37+5=", "add 37+5=", "rev tomal=", "sort 5193="]
REFS = ["42", "42", "lamot", "1359"]
TASKS = ["add", "add", "reverse", "sort"]


def test_exact_match_values():
    got = rewards.exact_match(PROMPTS, ["42", "42 ", "lamot", "1395"], completion=REFS)
    assert got == [1.0, 0.0, 1.0, 0.0]  # no stripping: "42 " is wrong, as in data.exact_match


def test_exact_match_mean_is_the_task_metric():
    completions = ["42", "41", "lamot", "1359"]
    got = rewards.exact_match(PROMPTS, completions, completion=REFS)
    assert np.mean(got) == data.exact_match(completions, REFS) == 0.75


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("42", "42", 1.0),
        ("41", "42", 1 / 2),
        ("420", "42", 2 / 3),  # an extra character costs
        ("4", "42", 1 / 2),
        ("24", "42", 0.0),  # by position
        ("", "42", 0.0),
        ("", "", 1.0),
        ("lamto", "lamot", 3 / 5),  # l, a, m in place
        ("tomal", "lamot", 1 / 5),  # not reversed: only the middle letter is a fixed point
    ],
)
def test_char_match_values(completion, reference, expected):
    assert rewards.char_match(["p"], [completion], completion=[reference]) == [pytest.approx(expected)]


def test_char_match_is_one_exactly_on_exact_match():
    completions = ["42", "4", "lamot", "13590"]
    em = rewards.exact_match(PROMPTS, completions, completion=REFS)
    cm = rewards.char_match(PROMPTS, completions, completion=REFS)
    assert [c == 1.0 for c in cm] == [e == 1.0 for e in em]


def test_well_formed_values():
    completions = ["99", "4a", "xyzab", "135"]
    # right length and digits; a letter in a sum; right length and letters (wrong, but
    # well formed); one digit short.
    assert rewards.well_formed(PROMPTS, completions, completion=REFS, task=TASKS) == [1.0, 0.0, 1.0, 0.0]


def test_well_formed_rejects_an_unknown_task():
    with pytest.raises(ValueError, match="task 'mul'.*add"):
        rewards.well_formed(["p"], ["1"], completion=["1"], task=["mul"])


@pytest.mark.parametrize("fn", [rewards.exact_match, rewards.char_match, rewards.well_formed])
def test_missing_or_short_columns_name_the_fix(fn):
    with pytest.raises(ValueError, match="'completion' column.*completion=\\[...\\]"):
        fn(PROMPTS, REFS, task=TASKS)
    with pytest.raises(ValueError, match="4 completions but 2 'completion' entries.*repeat each example G times"):
        fn(PROMPTS, REFS, completion=REFS[:2], task=TASKS)
    with pytest.raises(ValueError, match="3 prompts but 4 completions"):
        fn(PROMPTS[:3], REFS, completion=REFS, task=TASKS)


def test_reward_set_weighted_total_and_per_function():
    completions = ["42", "41", "lamto", "1359"]
    rs = rewards.combine([rewards.exact_match, rewards.char_match], weights=[1.0, 0.5])
    out = rs(PROMPTS, completions, completion=REFS, task=TASKS)
    np.testing.assert_array_equal(out.per_function["exact_match"], [1, 0, 0, 1])
    np.testing.assert_allclose(out.per_function["char_match"], [1, 0.5, 0.6, 1])
    np.testing.assert_allclose(out.total, [1.5, 0.25, 0.3, 1.5], rtol=1e-6)
    assert out.total.dtype == np.float32
    assert repr(rs) == "RewardSet(1 * exact_match, 0.5 * char_match)"


def test_reward_set_defaults_and_names():
    rs = rewards.RewardSet({"em": rewards.exact_match, "em2": rewards.exact_match})
    out = rs(["p", "q"], ["1", "2"], completion=["1", "1"])
    assert rs.weights == (1.0, 1.0) and list(out.per_function) == ["em", "em2"]
    np.testing.assert_array_equal(out.total, [2.0, 0.0])


def test_reward_set_errors():
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        rewards.combine([rewards.exact_match, rewards.char_match], weights=[1.0])
    with pytest.raises(ValueError, match="unique.*mapping"):
        rewards.combine([rewards.exact_match, rewards.exact_match])
    with pytest.raises(ValueError, match="at least one"):
        rewards.combine([])
    with pytest.raises(ValueError, match="finite"):
        rewards.combine([rewards.exact_match], weights=[float("nan")])

    def too_few(prompts, completions, **_):
        return [1.0]

    def not_finite(prompts, completions, **_):
        return [float("nan")] * len(completions)

    def words(prompts, completions, **_):
        return ["good"] * len(completions)

    for fn, msg in [(too_few, "'too_few' returned shape \\(1,\\) for 2"),
                    (not_finite, "'not_finite' returned a non-finite"),
                    (words, "'words' must return numbers")]:
        with pytest.raises(ValueError, match=msg):
            rewards.combine([fn])(["p", "q"], ["a", "b"])


def test_reward_metrics_names_and_values():
    # Two groups of G = 2: totals [1, 1] (zero std) and [1, 0].
    out = rewards.Rewards(
        total=np.array([1.0, 1.0, 1.0, 0.0], np.float32),
        per_function={"exact_match": np.array([1.0, 1.0, 1.0, 0.0], np.float32)},
    )
    m = rewards.reward_metrics(out, group_size=2)
    assert m["reward"] == 0.75 and m["frac_reward_zero_std"] == 0.5
    assert m["reward_std"] == pytest.approx(0.5)  # sample std of [1, 1, 1, 0]
    assert m["rewards/exact_match/mean"] == 0.75 and m["rewards/exact_match/std"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="groups of group_size=3"):
        rewards.reward_metrics(out, group_size=3)


def test_reward_funcs_come_from_the_file_found_now(tmp_path, monkeypatch):
    """A notebook kernel that ran the command with one my_rewards.py, then edits it or moves to
    another folder with its own, gets the new functions, not the module cached from the first."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    (first / "kit_test_rewards.py").write_text("def exact(prompts, completions, **_):\n    return [1.0] * len(completions)\n")
    (second / "kit_test_rewards.py").write_text("def length(prompts, completions, **_):\n    return [0.5] * len(completions)\n")
    try:
        monkeypatch.chdir(first)
        assert rewards.load_reward_funcs("kit_test_rewards:exact")["exact"](["p"], ["c"]) == [1.0]
        monkeypatch.chdir(second)
        assert rewards.load_reward_funcs("kit_test_rewards:length")["length"](["p"], ["c"]) == [0.5]
        with pytest.raises(ValueError, match="has no function 'exact'"):
            rewards.load_reward_funcs("kit_test_rewards:exact")
        (second / "kit_test_rewards.py").write_text("def length(prompts, completions, **_):\n    return [2.25] * len(completions)\n")
        assert rewards.load_reward_funcs("kit_test_rewards:length")["length"](["p"], ["c"]) == [2.25]
        assert rewards.load_reward_funcs("tunix_nb.rewards:exact_match")["exact_match"] is rewards.exact_match
    finally:
        sys.modules.pop("kit_test_rewards", None)
