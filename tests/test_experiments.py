"""Experiments over seeds: the statistics checked against closed forms and independent computations."""

from math import comb

import numpy as np
import pytest
from scipy import stats as scipy_stats

from tunix_nb.experiments import stats


def test_a_constant_gain_has_a_zero_width_interval():
    a = np.full((5, 100), 0.7)
    out = stats.paired_gain(a, a - 0.2)
    assert out["mean"] == pytest.approx(0.2) and out["ci95"] == pytest.approx([0.2, 0.2])
    assert out["per_seed"] == pytest.approx([0.2] * 5) and (out["seeds"], out["prompts"]) == (5, 100)


def test_the_gain_is_each_seeds_mean_difference_and_the_interval_is_over_those():
    """The prompts are fixed: each seed's gain is its mean over them, and the interval is
    `seed_interval`'s over the seeds' gains, by hand."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.3, 1.0, size=(6, 400)), rng.normal(0.1, 1.0, size=(6, 400))
    out = stats.paired_gain(a, b)
    by_hand = (a - b).mean(axis=1)
    assert out["per_seed"] == pytest.approx(list(by_hand)) and out["mean"] == pytest.approx(by_hand.mean())
    assert out["ci95"] == pytest.approx(stats.seed_interval(by_hand)["ci95"])
    assert (out["seeds"], out["prompts"], out["interval"]) == (6, 400, stats.INTERVAL_METHOD)
    assert stats.mean_interval(a)["ci95"] == pytest.approx(stats.seed_interval(a.mean(axis=1))["ci95"])


def test_the_interval_widens_with_seed_noise():
    """The same per-prompt noise, plus a gain that moves from seed to seed: the interval must
    cover the seeds' spread too (a prompt-only bootstrap would not)."""
    rng = np.random.default_rng(1)
    prompt_noise = rng.normal(0, 0.3, size=(5, 1000))
    quiet = stats.paired_gain(0.1 + prompt_noise, np.zeros((5, 1000)))
    seeds = np.array([-0.2, 0.0, 0.1, 0.2, 0.4])[:, None]
    noisy = stats.paired_gain(seeds + prompt_noise, np.zeros((5, 1000)))
    width = lambda out: out["ci95"][1] - out["ci95"][0]  # noqa: E731
    assert width(noisy) > 5 * width(quiet)
    assert noisy["ci95"][0] < 0 < noisy["ci95"][1]  # five seeds this spread cannot exclude 0


def test_one_seed_has_no_interval_and_says_so():
    out = stats.paired_gain(np.full((1, 4), 0.5), np.full((1, 4), 0.25))
    assert (out["mean"], out["ci95"], out["seeds"], out["interval"]) == (0.25, None, 1, stats.ONE_SEED)
    assert stats.describe_gain(out) == "+25.0 points (one seed, no interval)"


def test_pairing_removes_what_both_arms_share():
    """Prompt difficulty that both arms see cancels in a paired gain."""
    rng = np.random.default_rng(2)
    difficulty = rng.normal(0, 1, size=(3, 500))
    out = stats.paired_gain(difficulty + 0.05, difficulty)
    assert out["ci95"] == pytest.approx([0.05, 0.05])


@pytest.mark.parametrize("a, b, message", [
    (np.zeros((2, 3)), np.zeros((2, 4)), "one shape"),
    (np.zeros(3), np.zeros(3), "one shape"),
    (np.full((2, 3), np.nan), np.zeros((2, 3)), "NaN"),
])
def test_bad_scores_are_refused(a, b, message):
    with pytest.raises(ValueError, match=message):
        stats.paired_gain(a, b)


def test_seed_interval_of_equal_values_has_zero_width_and_names_its_method():
    out = stats.seed_interval([0.2] * 5)
    assert out["ci95"] == pytest.approx([0.2, 0.2]) and out["interval"] == stats.INTERVAL_METHOD
    with pytest.raises(ValueError, match="at least 2 seeds"):
        stats.seed_interval([0.2])
    with pytest.raises(ValueError, match="NaN"):
        stats.seed_interval([0.2, np.nan])


def test_symmetric_gains_get_students_t_interval():
    """No skewness: Hall's correction vanishes and the interval is mean +- t(0.975, S-1) x SE, by hand."""
    gains = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    out = stats.seed_interval(gains)
    half = 2.7764451051977987 * gains.std(ddof=1) / np.sqrt(5)  # t(0.975, 4)
    assert out["ci95"] == pytest.approx([0.3 - half, 0.3 + half])
    assert (out["mean"], out["median"], out["seeds"]) == (pytest.approx(0.3), pytest.approx(0.3), 5)


def test_the_seed_interval_leans_towards_a_high_outlier_seed():
    """Lesson 02's five gains at 300 labels (points): one seed about twice the others. The
    corrected interval reaches further above the mean than below it, and further up than the
    plain t-interval [15.2, 39.4]."""
    out = stats.seed_interval([24.0, 23.0, 44.7, 23.4, 21.6])
    lo, hi = out["ci95"]
    assert hi - out["mean"] > out["mean"] - lo
    assert hi > 39.4 and out["median"] == 23.4


def _coverage(interval, n_seeds, draws=1000, mean_gain=0.27):
    """How often `interval` covers the true mean over `draws` experiments of `n_seeds` seeds whose
    gains are skewed as lesson 02's: mean_gain x Gamma(2)/2, where the largest of 5 seeds' gains
    is a median 2.0 times their median."""
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(draws):
        lo, hi = interval(mean_gain * rng.gamma(2.0, 0.5, n_seeds))
        hits += lo <= mean_gain <= hi
    return hits / draws


def _plain_t(gains):
    half = scipy_stats.t.ppf(0.975, len(gains) - 1) * gains.std(ddof=1) / np.sqrt(len(gains))
    return gains.mean() - half, gains.mean() + half


def _seed_bootstrap(gains, draws=2000):
    """The percentile bootstrap over seeds (the seed level of the records' old interval)."""
    rng = np.random.default_rng(1)
    means = gains[rng.integers(0, len(gains), size=(draws, len(gains)))].mean(axis=1)
    return np.quantile(means, [0.025, 0.975])


@pytest.mark.parametrize("n_seeds", [5, 10])
def test_the_seed_interval_covers_skewed_gains(n_seeds):
    """Between 92% and 98% over 1,000 draws (binomial SE 0.8%), where the plain t and the
    bootstrap over seeds cover less."""
    covered = _coverage(lambda g: stats.seed_interval(g)["ci95"], n_seeds)
    assert 0.92 <= covered <= 0.98
    assert _coverage(_plain_t, n_seeds) < covered
    assert _coverage(_seed_bootstrap, n_seeds) < 0.92


def test_pass_at_k_is_the_chance_that_k_of_n_hold_a_right_one():
    assert stats.pass_at_k(2, 1, 1) == 0.5 and stats.pass_at_k(2, 1, 2) == 1.0
    assert stats.pass_at_k(10, 0, 5) == 0.0 and stats.pass_at_k(10, 10, 1) == 1.0
    # by enumeration: every k-subset of n samples, c of them right
    from itertools import combinations
    n, c, k = 7, 2, 3
    subsets = list(combinations(range(n), k))
    assert stats.pass_at_k(n, c, k) == pytest.approx(sum(any(i < c for i in s) for s in subsets) / comb(n, k))
    with pytest.raises(ValueError, match="1 <= k <= n"):
        stats.pass_at_k(4, 1, 5)


def test_pass_at_k_curve_is_per_prompt_and_rises_with_k():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    curve = stats.pass_at_k_curve(correct, ks=[1, 2, 4])
    np.testing.assert_allclose(curve[:, 0], [0.25, 0.5, 1.0])
    np.testing.assert_allclose(curve[:, 1], 0.0)
    np.testing.assert_allclose(curve[:, 2], 1.0)


@pytest.mark.parametrize("a, b, distance", [("", "", 0), ("abc", "abc", 0), ("abc", "", 3), ("kitten", "sitting", 3),
                                            ("lamot", "tomal", 4), ("1359", "1539", 2)])
def test_edit_distance_is_levenshteins(a, b, distance):
    assert stats.edit_distance(a, b) == distance == stats.edit_distance(b, a)


def test_rank_correlation_is_spearmans_closed_form_without_ties():
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(size=12), rng.normal(size=12)
    d = xs.argsort().argsort() - ys.argsort().argsort()  # rank differences
    assert stats.rank_correlation(xs, ys) == pytest.approx(1 - 6 * (d ** 2).sum() / (12 * (12 ** 2 - 1)))
    assert stats.rank_correlation(xs, np.exp(3 * xs)) == pytest.approx(1.0)  # any monotone rise
    assert stats.rank_correlation(xs, -xs) == pytest.approx(-1.0)


def test_rank_correlation_gives_ties_their_mean_rank_and_refuses_short_input():
    # ranks (0.5, 0.5, 2, 3) against (0, 1, 2, 3): Pearson's correlation by hand
    a, b = np.array([0.5, 0.5, 2, 3]), np.arange(4.0)
    expected = ((a - a.mean()) * (b - b.mean())).sum() / np.sqrt(((a - a.mean()) ** 2).sum() * ((b - b.mean()) ** 2).sum())
    assert stats.rank_correlation([7, 7, 8, 9], [1, 2, 3, 4]) == pytest.approx(expected)
    assert stats.rank_correlation([0.1 + 0.2, 0.3, 0.4, 0.5], [1, 2, 3, 4]) == pytest.approx(expected)  # float rounding ties
    with pytest.raises(ValueError, match="same length, at least 3"):
        stats.rank_correlation([1, 2], [1, 2])


def test_edit_similarity_credits_a_long_answer_with_one_slip():
    assert stats.edit_similarity("danisubegeke", "danisubegeke") == 1.0
    assert stats.edit_similarity("danisubgeke", "danisubegeke") == pytest.approx(11 / 12)  # one letter dropped
    assert stats.edit_similarity("", "abc") == 0.0 and stats.edit_similarity("", "") == 1.0


def test_describe_gain_prints_the_mean_and_interval_in_points():
    gain = {"mean": 0.30125, "ci95": [0.27, -0.0149]}
    assert stats.describe_gain(gain) == "+30.1 points (95% interval +27.0 to -1.5)"
    assert stats.describe_gain(gain, scale=1, decimals=4, unit="") == "+0.3013 (95% interval +0.2700 to -0.0149)"


class _CountingExperiment:
    """A stand-in experiment: one setting, two arms, scores from the seed; counts its runs."""

    NAME, ARMS = "counting", ("a", "b")

    def __init__(self, fail_after=None):
        self.calls, self.fail_after = 0, fail_after

    def prepare(self, config):
        return {"record": {"prepared": True}}

    def settings(self, config):
        return ["only"]

    def run_arm(self, arm, seed, config, shared, setting):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("stopped")
        self.calls += 1
        return {"scores": [float(seed), float(arm == "a")]}


def test_an_interrupted_experiment_resumes_from_its_partial_record(tmp_path):
    import dataclasses

    from tunix_nb.experiments import runner

    @dataclasses.dataclass(frozen=True)
    class Config:
        steps: int = 3

    partial = tmp_path / "x.json.partial"
    with pytest.raises(KeyboardInterrupt):
        runner.run_experiment(_CountingExperiment(fail_after=3), Config(), range(2), command="c", partial=partial)
    resumed = _CountingExperiment()
    record = runner.run_experiment(resumed, Config(), range(2), command="c", partial=partial)
    assert resumed.calls == 1  # three runs were stored before the stop; only the fourth runs again
    whole = runner.run_experiment(_CountingExperiment(), Config(), range(2), command="c")
    strip = lambda rec: {s: {a: [{k: v for k, v in r.items() if k != "seconds"} for r in runs]  # noqa: E731
                             for a, runs in arms.items()} for s, arms in rec["runs"].items()}
    assert strip(record) == strip(whole) and record["setup"] == {"prepared": True}
    changed = _CountingExperiment()  # another config: nothing is reused
    runner.run_experiment(changed, Config(steps=4), range(2), command="c", partial=partial)
    assert changed.calls == 4


def test_set_changes_one_config_field_by_its_type_and_names_the_fields_when_wrong():
    from tunix_nb.experiments.__main__ import configured
    from tunix_nb.experiments.gkd_long_answers import GkdLongConfig

    config = configured(GkdLongConfig, ["lmbda=0.5", "steps=400", "eval_split=validation"])
    assert (config.lmbda, config.steps, config.eval_split) == (0.5, 400, "validation")
    with pytest.raises(ValueError, match="one of steps, batch_size"):
        configured(GkdLongConfig, ["lambda=0.5"])
    with pytest.raises(ValueError, match="steps must be int"):
        configured(GkdLongConfig, ["steps=many"])
    with pytest.raises(ValueError, match="'test' .* or 'validation'"):
        configured(GkdLongConfig, ["eval_split=train"])
    assert configured(GkdLongConfig, ["family=count"]).family == "count"
    with pytest.raises(ValueError, match="family is one of long, count, count14; got 'short'"):
        configured(GkdLongConfig, ["family=short"])
    assert configured(GkdLongConfig, ["family=count14"]).family == "count14"
    with pytest.raises(ValueError, match="got 'small_student' with family='count14'"):
        configured(GkdLongConfig, ["family=count14", "student=small_student"])
    assert configured(GkdLongConfig, ["family=count", "student=small_student"]).student == "small_student"
    with pytest.raises(ValueError, match="'small_student' with family=count; got 'small_student' with family='long'"):
        configured(GkdLongConfig, ["student=small_student"])
    assert configured(GkdLongConfig, ["offline_slip_taught=False"]).offline_slip_taught is False  # not bool("False")
    assert configured(GkdLongConfig, ["offline_slip_taught=true"]).offline_slip_taught is True
    with pytest.raises(ValueError, match="offline_slip_taught must be bool, got 'no'"):
        configured(GkdLongConfig, ["offline_slip_taught=no"])


def test_wrong_prefixes_swap_answer_inputs_for_another_of_the_rows_digits_and_keep_every_target():
    """The count teacher's recipe: a share of the answer tokens, as inputs, swapped; the targets
    (the right answer, position by position) and everything outside the answer untouched."""
    import numpy as np

    from tunix_nb import data
    from tunix_nb.experiments.long_family import with_wrong_prefixes
    from tunix_nb.tokenizer import ByteTokenizer

    rows = data.sft_arrays(data.generate_sft(256, seed=0, family="count"), ByteTokenizer(), data.LONG_SEQ_LEN)
    assert with_wrong_prefixes(rows, 0.0, seed=0) is rows
    swapped = with_wrong_prefixes(rows, 0.1, seed=(0, 3))
    np.testing.assert_array_equal(swapped["targets"], rows["targets"])
    changed_BxL = swapped["inputs"] != rows["inputs"]
    answer_input_BxL = np.zeros_like(changed_BxL)
    answer_input_BxL[:, 1:] = (rows["loss_mask"][:, 1:] > 0) & (rows["loss_mask"][:, :-1] > 0)
    assert not (changed_BxL & ~answer_input_BxL).any()  # the prompt, the first answer token's input, eos: kept
    assert 0.03 < changed_BxL.sum() / answer_input_BxL.sum() < 0.1  # a tenth drawn; a swap for an equal digit changes nothing
    for row, col in zip(*np.nonzero(changed_BxL)):  # each swap is another of the row's answer digits
        assert swapped["inputs"][row, col] in rows["inputs"][row][answer_input_BxL[row]]
    np.testing.assert_array_equal(with_wrong_prefixes(rows, 0.1, seed=(0, 3))["inputs"], swapped["inputs"])


def test_lesson11s_offline_slip_rate_swaps_the_offline_arms_answer_inputs_and_nothing_else():
    """The diagnostic arm: offline batches with a share of their answer inputs swapped, the
    same rows in the same order as plain offline batches; its control leaves every position
    after a row's first swap out of the loss."""
    import numpy as np

    from tunix_nb import data
    from tunix_nb.experiments import gkd_long_answers as gkd_long

    shared = {"teacher_train": data.generate_sft(64, seed=0, family="count")}
    plain = gkd_long.offline_batches(0, gkd_long.GkdLongConfig(batch_size=16), shared)
    slipped = gkd_long.offline_batches(0, gkd_long.GkdLongConfig(batch_size=16, offline_slip_rate=0.3), shared)
    for step in (0, 5):
        a, b = plain(step), slipped(step)
        for key in ("targets", "loss_mask", "attention_mask"):
            np.testing.assert_array_equal(a[key], b[key])
        changed = a["inputs"] != b["inputs"]
        assert changed.any() and not (changed & (a["loss_mask"] == 0)).any()  # answer inputs only
        np.testing.assert_array_equal(slipped(step)["inputs"], b["inputs"])  # drawn from (seed, step)

    # the control: the same swapped rows, nothing from a row's first swap on in the loss
    control = gkd_long.offline_batches(0, gkd_long.GkdLongConfig(batch_size=16, offline_slip_rate=0.3,
                                                                 offline_slip_taught=False), shared)
    a, b, c = plain(2), slipped(2), control(2)
    np.testing.assert_array_equal(c["inputs"], b["inputs"])
    for row in range(16):
        swaps = np.flatnonzero(b["inputs"][row] != a["inputs"][row])
        cut = swaps[0] if len(swaps) else a["inputs"].shape[1]
        np.testing.assert_array_equal(c["loss_mask"][row, :cut], a["loss_mask"][row, :cut])
        assert not c["loss_mask"][row, cut:].any()
    assert 0 < c["loss_mask"].sum() < a["loss_mask"].sum()


def test_lesson11s_warm_start_is_offline_distillation_shared_by_both_arms_of_a_seed():
    """`offline_first`: both arms of a seed start from the same student, trained offline
    first (once, cached); the offline arm then carries on with the batches after those."""
    import jax
    import numpy as np

    from tunix_nb import data, model
    from tunix_nb.experiments import gkd_long_answers as gkd_long
    from tunix_nb.tokenizer import ByteTokenizer

    examples = data.generate_sft(16, seed=0, family="long")
    shared = {"student": model.split(model.make_model("tiny", seed=0)),
              "teacher": model.split(model.make_model("tiny", seed=1)), "teacher_train": examples}
    cold = gkd_long.GkdLongConfig(batch_size=4, steps=1)
    assert gkd_long.warm_start(0, cold, shared) is shared["student"][1]  # no warm start: the student as shipped
    warm = gkd_long.GkdLongConfig(batch_size=4, steps=1, offline_first=12)  # past the 10 warmup steps
    first = gkd_long.warm_start(0, warm, shared)
    assert gkd_long.warm_start(0, warm, shared) is first  # trained once per seed, whichever arm asks first
    moved = lambda a, b: max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa: E731
    assert moved(first, shared["student"][1]) > 0 and moved(first, gkd_long.warm_start(1, warm, shared)) > 0
    rows = data.sft_arrays(examples, ByteTokenizer(), data.LONG_SEQ_LEN)
    after = gkd_long.offline_batches(0, warm, shared, first=12)(0)
    np.testing.assert_array_equal(after["inputs"], data.batch_at(rows, 12, 4, seed=0)["inputs"])


def test_lesson11s_sub_task_summary_counts_the_wrong_answers_edits_and_shifts_by_hand():
    """`by_task_summary` on a hand-made record: one seed, three answers per sub-task, all in the
    longest third; the figures are what counting the wrong answers by hand gives."""
    from tunix_nb.experiments import gkd_long_answers as gkd_long

    gold = ["abcdef", "ghijkl", "mnopqr", "001122", "334455", "667788"]
    tasks = ["long_reverse"] * 3 + ["long_sort"] * 3
    own = {"offline": ["abcdef", "gxijkl", "mnopqr", "00122", "334455", "6677888"],  # 1 swap; 1 dropped, 1 extra
           "on_policy": ["abcdxf", "gxijky", "mnopqr", "001122", "34455", "667788"]}  # 1 and 2 swaps; 1 dropped

    def run(arm):
        answers = own[arm]
        figures = {"own_prefix_share": 0.5, "free_running_error": 0.1, "teacher_forced_error": 0.05}
        return {"scores": [stats.edit_similarity(a, g) for a, g in zip(answers, gold)],
                "exact_match": [float(a == g) for a, g in zip(answers, gold)],
                "answer_length": [len(g) for g in gold], "task": tasks,
                "edits": [stats.edit_distance(a, g) for a, g in zip(answers, gold)],
                "own_length": [len(a) for a in answers], **figures,
                "by_task": {t: {**figures, "own_prefix_share": 0.2 if arm == "on_policy" else 0.4} for t in set(tasks)}}

    runs = {arm: [run(arm)] for arm in gkd_long.ARMS}
    every = np.ones(6, bool)
    reverse = gkd_long.by_task_summary(runs, every, "long_reverse")
    assert reverse["edits_per_wrong_answer"] == {"offline": 1.0, "on_policy": 1.5}
    assert reverse["wrong_answers_of_the_wrong_length"] == {"offline": 0.0, "on_policy": 0.0}
    assert reverse["exact_match"]["mean"] == pytest.approx(-1 / 3)
    assert reverse["own_prefix_share_longest_third"]["on_policy"]["per_seed"] == [0.2]
    sort = gkd_long.by_task_summary(runs, every, "long_sort")
    assert sort["wrong_answers_of_the_wrong_length"] == {"offline": 1.0, "on_policy": 1.0}
    assert sort["edits_per_wrong_answer"] == {"offline": 1.0, "on_policy": 1.0}
    summary = gkd_long.summarise({"runs": {gkd_long.HEADLINE: runs}})
    assert summary["by_task"]["long_sort"] == sort


def test_after_a_slip_agrees_with_greedy_generation_after_the_slipped_prefix():
    """`count_family.after_a_slip` (one teacher-forced pass over slipped answers) against another
    path: the slipped answer's first k + 1 digits put in the prompt, and one greedy token generated
    (the KV-cache generator, left-padded). The shipped teacher corrects a slip; the student carries
    many on."""
    import numpy as np

    from tunix_nb import data, evaluate
    from tunix_nb.experiments import count_family

    examples = count_family.splits()["validation"][:64]
    rng = np.random.default_rng(0)  # after_a_slip's draw for seed 0
    slip_at = [int(rng.integers(0, len(e["completion"]) - 1)) for e in examples]
    found = {}
    for which in ("student", "teacher"):
        graphdef, params = count_family.load(which)
        prefixes = [e["prompt"] + count_family.with_slip(e, k)["completion"][:k + 1] for e, k in zip(examples, slip_at)]
        next_digit = [a[:1] for a in evaluate.generate_answers(graphdef, params, prefixes,
                                                               prompt_len=data.LONG_PROMPT_LEN + data.LONG_MAX_NEW_TOKENS,
                                                               max_new_tokens=1)]
        right = np.mean([d == e["completion"][k + 1] for d, e, k in zip(next_digit, examples, slip_at)])
        carried = np.mean([d == str((int(e["completion"][k]) + 1 + int(e["prompt"][4 + k + 1])) % 10)
                           for d, e, k in zip(next_digit, examples, slip_at)])
        found[which] = count_family.after_a_slip(graphdef, params, examples)
        assert found[which] == {"right": float(right), "carried": float(carried)}, which
    assert found["teacher"]["right"] > 0.95 and found["student"]["carried"] > 0.25


def test_after_own_slip_reads_what_an_answer_does_after_its_own_first_wrong_digit():
    """`count_family.after_own_slip` on answers worked by hand for "cnt 1011=" -> "1123"."""
    from tunix_nb.experiments import count_family

    example = {"prompt": "cnt 1011=", "completion": "1123", "task": "running_count"}
    answers = {"1123": "right throughout: no slip",
               "1124": "wrong only at the last digit: nothing after it",
               "1223": "slip at digit 1, then the right digit 2",
               "1234": "slip at digit 1 (2), carried on: 2 + bit 2 (1) = 3",
               "1": "too short: its digit 1 is missing, neither",
               "1x23": "a non-digit slip, then the right digit"}
    found = count_family.after_own_slip(list(answers), [example] * len(answers))
    assert found == {"slips": 4, "right": 2 / 4, "carried": 1 / 4}
    assert count_family.after_own_slip(["1123"], [example]) == {"slips": 0, "right": 0.0, "carried": 0.0}
    # mod 10: a slip to 9 carried on with a 1 bit is 0
    wraps = {"prompt": "cnt 111111111111=", "completion": "123456789012", "task": "running_count"}
    assert count_family.after_own_slip(["123456790123"], [wraps])["carried"] == 1.0


def test_errors_after_own_end_splits_the_errors_at_each_answers_own_eos_counted_by_hand():
    """`evaluate.errors_after_own_end` against a count made from the greedy answers themselves:
    the small student stops early on some long running counts; every position after its eos is
    a free-running error, and the split adds up to `error_rates`' totals."""
    import numpy as np

    from tunix_nb import data, evaluate
    from tunix_nb.experiments import count_family, long_family

    examples = [e for e in count_family.splits()["validation"] if len(e["completion"]) == 14][:120]
    graphdef, params = count_family.load("small_student")
    right = evaluate.right_tokens_by_row(graphdef, params, examples, seq_len=data.LONG_SEQ_LEN, **long_family.LENGTHS)
    answers = evaluate.generate_answers(graphdef, params, [e["prompt"] for e in examples], **long_family.LENGTHS)
    found = evaluate.errors_after_own_end(right)
    free_within = free_after = forced_after = 0
    for n, (answer, example) in enumerate(zip(answers, examples)):
        own, gold = answer + "$", example["completion"] + "$"  # "$": the eos, a token like any other
        for k, token in enumerate(gold):
            if k < len(own):
                free_within += own[k] != token
            else:  # no token of its own here: an error, and one the right prefix need not make
                free_after += 1
                forced_after += not right["teacher_forced"][n, k]
    assert found["within"]["free_running"] == free_within and found["after_end"]["free_running"] == free_after
    assert found["after_end"]["teacher_forced"] == forced_after
    rates = evaluate.error_rates(right)
    for key in ("free_running", "teacher_forced"):
        assert found["within"][key] + found["after_end"][key] == round((rates[key] * rates["rows"]).sum())
    assert sum(len(a) < 14 for a in answers) > 0 and free_after > forced_after  # it does stop early here
    part = np.arange(len(examples)) < 40  # any subset of the rows, as error_rates takes
    assert evaluate.errors_after_own_end(right, part) == evaluate.errors_after_own_end(
        {key: value[part] for key, value in right.items()})


def test_lesson11s_own_end_summary_leaves_an_early_eos_tail_out_of_the_share_by_hand():
    """Two seeds of made-up counts: the share within the answers is (free - forced) / free inside
    them, and the tail's part is the after-end own-prefix errors over all own-prefix errors."""
    from tunix_nb.experiments import gkd_long_answers as gkd_long

    def counts(within, after):
        return {"errors_by_own_end": {"within": dict(zip(("free_running", "teacher_forced"), within)),
                                      "after_end": dict(zip(("free_running", "teacher_forced"), after))}}

    runs = {"offline": [counts((100, 60), (30, 5)), counts((80, 60), (10, 10))],
            "on_policy": [counts((70, 63), (26, 5)), counts((0, 0), (0, 0))]}
    found = gkd_long.own_end_summary(runs)
    within = found["own_prefix_share_within_answer_longest_third"]
    assert within["offline"]["per_seed"] == [0.4, 0.25] and within["offline"]["mean"] == pytest.approx(0.325)
    assert within["on_policy"]["per_seed"] == [0.1, 0.0]  # no error at all: 0, not a NaN
    tail = found["tail_part_of_own_prefix_errors_longest_third"]
    assert tail["offline"]["per_seed"] == [25 / 65, 0.0] and tail["on_policy"]["per_seed"] == [0.75, 0.0]


def test_count_family_loads_its_three_checkpoints_each_made_by_its_recipe():
    import dataclasses

    from tunix_nb import checkpoint, model
    from tunix_nb.experiments import count_family

    for which, (recipe, directory) in count_family.CHECKPOINTS.items():
        graphdef, params = count_family.load(which)
        meta = checkpoint.load_meta(directory)
        assert meta["recipe"] == dataclasses.asdict(recipe) and meta["model"] == recipe.preset, which
        assert model.count_params(params) == model.count_params(model.split(model.make_model(recipe.preset))[1])
    with pytest.raises(ValueError, match="one of teacher, student, small_student; got 'tiny'"):
        count_family.load("tiny")


def test_count14_family_loads_its_student_made_by_its_recipe_and_the_count_teacher():
    """The fourth design's student (`data/count14_student`) is its recipe's, and its splits hold
    running counts of 14 bits, no prompt in two of them."""
    import dataclasses

    import jax
    import numpy as np

    from tunix_nb import checkpoint
    from tunix_nb.experiments import count14_family, count_family

    meta = checkpoint.load_meta(count14_family.STUDENT_DIR)
    assert meta["recipe"] == dataclasses.asdict(count14_family.STUDENT) and meta["family"] == "count14"
    teacher = count14_family.load("teacher")[1]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(teacher),
                                                     jax.tree.leaves(count_family.load("teacher")[1])))
    splits = count14_family.splits()
    assert {name: len(rows) for name, rows in splits.items()} == count14_family.SIZES
    prompts = [e["prompt"] for rows in splits.values() for e in rows]
    assert len(set(prompts)) == len(prompts) and {len(p) for p in prompts} == {len("cnt =") + 14}
    with pytest.raises(ValueError, match="'student' or 'teacher'; got 'small_student'"):
        count14_family.load("small_student")


def test_summarise_rewrites_a_records_summary_from_its_runs(tmp_path, capsys):
    """`python -m tunix_nb.experiments summarise FILE`, after a change to the statistics: the
    summary is recomputed from the runs, and a file that is no experiment record is refused."""
    import json
    from pathlib import Path

    from tunix_nb.experiments import __main__ as experiments_cli
    from tunix_nb.experiments import gkd_long_answers

    stored = json.loads((Path(__file__).parent.parent / "results/lesson11_pilots/mixed_half_400_steps.json").read_text())
    path = tmp_path / "record.json"
    path.write_text(json.dumps({**stored, "summary": {}}))
    assert experiments_cli.main(["summarise", str(path)]) == 0
    assert json.loads(path.read_text())["summary"] == json.loads(json.dumps(gkd_long_answers.summarise(stored)))
    (tmp_path / "other.json").write_text(json.dumps({"experiment": "lesson99"}))
    assert experiments_cli.main(["summarise", str(tmp_path / "other.json")]) == 2
    assert "not an experiment record" in capsys.readouterr().err


# ------------------------------------------------------------------ lesson 02's rerun options


def test_lesson02_options_refuse_what_they_cannot_run():
    from tunix_nb.experiments import scarce_labels

    with pytest.raises(ValueError, match="eval_split"):
        scarce_labels.ScarceLabelsConfig(eval_split="train")
    with pytest.raises(ValueError, match="labelled_pool=500 holds fewer prompts than the largest label count 1000"):
        scarce_labels.ScarceLabelsConfig(labelled_pool=500)
    with pytest.raises(ValueError, match="'arm=value' items"):
        scarce_labels.ScarceLabelsConfig(learning_rates="students=1e-2")
    config = scarce_labels.ScarceLabelsConfig(learning_rates="labels=1e-2, distilled=1e-3")
    assert [config.learning_rate_of(arm) for arm in scarce_labels.ARMS] == [1e-2, 3e-3, 1e-3]


def test_lesson02_seeds_draw_their_own_labelled_prompts_from_a_pool():
    """With labelled_pool, each seed trains on its own n of the pool (every arm of the seed on the
    same n, nested as n grows); without it, every seed on the pool's first n, as the stored run."""
    from tunix_nb.experiments import scarce_labels

    shared = {"labelled": [{"prompt": str(i)} for i in range(50)]}
    fixed = scarce_labels.ScarceLabelsConfig()
    pooled = scarce_labels.ScarceLabelsConfig(label_counts=(10, 30), labelled_pool=50)
    assert scarce_labels.labelled_examples(shared, 10, 3, fixed) == shared["labelled"][:10]
    draws = [scarce_labels.labelled_examples(shared, 10, seed, pooled) for seed in range(3)]
    assert draws[0] == scarce_labels.labelled_examples(shared, 10, 0, pooled)  # the same for every arm
    assert draws[0] != draws[1] != draws[2] and len({e["prompt"] for e in draws[1]}) == 10
    assert scarce_labels.labelled_examples(shared, 30, 1, pooled)[:10] == draws[1]


def test_set_reads_tuples_and_per_arm_learning_rates():
    from tunix_nb.experiments import __main__ as experiments_cli
    from tunix_nb.experiments import scarce_labels

    config = experiments_cli.configured(scarce_labels.ScarceLabelsConfig,
                                        ["label_counts=100,300", "learning_rates=labels=1e-2", "eval_split=validation"])
    assert config.label_counts == (100, 300) and config.learning_rate_of("labels") == 1e-2
    with pytest.raises(ValueError, match="label_counts must be tuple"):
        experiments_cli.configured(scarce_labels.ScarceLabelsConfig, ["label_counts=100,many"])


def test_a_lesson02_pilot_scores_validation_prompts_only(tmp_path):
    """eval_split=validation: each run's scores and teacher agreement are over the validation
    prompts (the test prompts are never generated for), at each arm's own learning rate."""
    import json

    from tunix_nb.experiments import __main__ as experiments_cli

    out = tmp_path / "pilot.json"
    settings = ["label_counts=4", "labelled_pool=8", "unlabelled=8", "val_prompts=6", "test_prompts=5", "steps=2",
                "eval_every=1", "batch_size=4", "eval_split=validation", "learning_rates=labels=1e-2"]
    assert experiments_cli.main(["lesson02_distillation", "--seeds", "2", "--out", str(out),
                                 *(arg for s in settings for arg in ("--set", s))]) == 0
    record = json.loads(out.read_text())
    runs = record["runs"]["labels=4"]
    assert all(len(run["scores"]) == len(run["agrees_with_teacher"]) == 6 for arm in runs.values() for run in arm)
    assert [point["step"] for point in runs["labels"][0]["curve"]] == [1, 2]
    assert record["config"]["learning_rates"] == "labels=1e-2" and record["config"]["labelled_pool"] == 8


def test_lesson11_scores_each_arm_at_its_best_validation_checkpoint():
    """eval_every: one trajectory per arm (one schedule), the validation curve along it, and the
    scores at the best checkpoint, which is one the curve holds; eval_every must divide steps."""
    from tunix_nb.experiments import gkd_long_answers as gkd_long

    with pytest.raises(ValueError, match="eval_every=3 must divide steps=8"):
        gkd_long.GkdLongConfig(steps=8, eval_every=3)
    config = gkd_long.GkdLongConfig(family="count14", steps=12, eval_every=6, batch_size=8, eval_split="validation")
    shared = gkd_long.prepare(config)
    shared["validation"] = shared["validation"][:12]  # scored at every checkpoint: a few prompts keep it quick
    for arm in gkd_long.ARMS:
        run = gkd_long.run_arm(arm, 0, config, shared)
        curve = {point["step"]: point["val_edit_similarity"] for point in run["curve"]}
        assert sorted(curve) == [6, 12] and run["chosen_step"] == max(curve, key=lambda s: (curve[s], -s))
        assert np.mean(run["scores"]) == pytest.approx(curve[run["chosen_step"]])  # validation scored: the same


def test_lesson08_trajectories_are_scored_at_their_best_checkpoint_and_greedy_is_on_the_grid():
    """eval_every: GRPO (and RFT, through the same best_checkpoint) trains one trajectory, scored at
    the checkpoint of best validation pass@1 at temperature 1; a temperature of 0 on the grid is
    the greedy answer."""
    from tunix_nb.experiments import grpo_pass_at_k as grpo_exp
    from tunix_nb.experiments import long_family

    with pytest.raises(ValueError, match="each >= 0"):
        grpo_exp.GrpoPassAtKConfig(temperatures=(-0.5, 1.0))
    config = grpo_exp.GrpoPassAtKConfig(steps=8, eval_every=4, prompts_per_step=2, group_size=2, pass_at_1_samples=2,
                                        pass_at_k_samples=2, ks=(1, 2), temperatures=(0.0, 1.0), rft_batch_size=4)
    parts = long_family.splits(n_fresh=config.steps * config.prompts_per_step)
    shared = {**parts, "validation": parts["validation"][:8], "test": parts["test"][:6],
              "student": long_family.load("student")}
    run = grpo_exp.run_arm("grpo", 0, config, shared)
    curve = {point["step"]: point["val_pass_at_1_t1"] for point in run["curve"]}
    assert sorted(curve) == [4, 8] and run["chosen_step"] == max(curve, key=lambda s: (curve[s], -s))
    assert len(run["reward_curve"]) == 8  # the whole trajectory's training rewards
    sft = grpo_exp.run_arm("sft", 0, config, shared)
    greedy_val = long_family.greedy_correct(*shared["student"], shared["validation"]).mean()
    assert sft["validation_pass_at_1"]["0.0"] == pytest.approx(greedy_val) and "curve" not in sft


def _pilot(lr, scores_by_arm, **config):
    return {"config": {"learning_rate": lr, "eval_split": "validation", "steps": 40, **config},
            "runs": {"long": {arm: [{"scores": s, "chosen_step": 20} for s in seeds] for arm, seeds in scores_by_arm.items()}}}


def test_pilots_choose_each_arms_value_on_validation_and_refuse_unlike_pilots(capsys):
    from tunix_nb.experiments import __main__ as experiments_cli
    from tunix_nb.experiments import pilots

    low = _pilot(1e-3, {"offline": [[1, 1], [1, 0]], "on_policy": [[0, 0], [0, 1]]})
    high = _pilot(3e-3, {"offline": [[0, 1], [1, 0]], "on_policy": [[1, 1], [1, 0]]})
    choice = pilots.choose([low, high], "learning_rate")["long"]
    assert (choice["offline"]["chosen"], choice["on_policy"]["chosen"]) == (1e-3, 3e-3)
    assert choice["offline"]["by_value"][1e-3]["mean"] == 0.75 and choice["offline"]["chosen_steps"][1e-3] == [20, 20]
    assert "offline: learning_rate 0.001: 0.7500 *, 0.003: 0.5000" in pilots.describe({"long": choice}, "learning_rate")
    with pytest.raises(ValueError, match="scored on 'test'"):
        pilots.choose([low, _pilot(3e-3, {"offline": [[1], [1]]}, eval_split="test")], "learning_rate")
    with pytest.raises(ValueError, match="differ in steps besides learning_rate"):
        pilots.choose([low, _pilot(3e-3, {"offline": [[1], [1]]}, steps=80)], "learning_rate")
    assert experiments_cli.main(["choose", "learning_rate"]) == 2 and "usage" in capsys.readouterr().err
    together = pilots.choose([_pilot(1e-3, {"rft": [[1], [1]]}, rft_learning_rate=3e-3),
                              _pilot(3e-4, {"rft": [[0], [1]]}, rft_learning_rate=1e-3)], "learning_rate,rft_learning_rate")
    assert together["long"]["rft"]["chosen"] == "0.001/0.003"


def _record_with_curves(curves_by_arm: dict) -> dict:
    """A record whose runs keep validation curves at steps 40, 80, ... (one list per seed)."""
    runs = {arm: [{"curve": [{"step": 40 * (i + 1), "val_edit_similarity": v} for i, v in enumerate(values)],
                   "chosen_step": 40 * (int(np.argmax(values)) + 1)} for values in seeds]
            for arm, seeds in curves_by_arm.items()}
    return {"runs": {"long": runs}}


def test_steps_to_reach_is_each_seeds_first_checkpoint_at_the_score():
    from tunix_nb.experiments import pilots

    record = _record_with_curves({"offline": [[0.5, 0.97, 1.0], [0.5, 0.5, 0.97]],
                                  "on_policy": [[0.96, 0.97, 0.98], [0.95, 0.99, 0.99]]})
    assert pilots.steps_to_reach(record, "offline", 0.96) == [80, 120]
    assert pilots.steps_to_reach(record, "on_policy", 0.96) == [40, 80]
    assert pilots.steps_to_reach(record, "on_policy", 0.999) == [None, None]
    del record["runs"]["long"]["offline"][0]["curve"]
    with pytest.raises(ValueError, match="--set eval_every=N"):
        pilots.steps_to_reach(record, "offline", 0.9)


def test_validation_curves_plot_each_trained_arm_and_mark_the_chosen_checkpoints():
    import matplotlib

    matplotlib.use("Agg")
    from tunix_nb.experiments import figures

    record = _record_with_curves({"offline": [[0.5, 0.9, 1.0], [0.5, 0.5, 0.97]],
                                  "on_policy": [[0.96, 0.97, 0.98], [0.95, 0.99, 0.99]]})
    record["runs"]["long"]["untrained"] = [{"scores": [0.5]}, {"scores": [0.5]}]  # lesson 08's SFT arm: no curve
    ax = figures.plot_validation_curves(record, title="t").axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["offline", "on_policy"]
    marked = [c.get_offsets().tolist() for c in ax.collections if c.get_offsets().shape[0] == 2 and
              c.__class__.__name__ == "PathCollection"]
    assert marked == [[[120, 1.0], [120, 0.97]], [[120, 0.98], [80, 0.99]]]  # each seed's chosen checkpoint


def test_a_results_page_script_runs_its_cells_in_one_namespace_and_prints_under_each(tmp_path):
    """`page`: prose cells lose their comment marks, code cells share one namespace, and each
    prints under its code; text before the first marker (the script's header) is left out."""
    from tunix_nb.experiments import page

    script = tmp_path / "demo.py"
    script.write_text('"""The header."""\n\n# %% [markdown]\n# ## A title\n#\n# Some prose.\n\n'
                      "# %%\nx = 2 + 3\n\n# %%\nprint(f'x is {x}')\n")
    text, cells = page.render(script)
    assert [c["cell_type"] for c in cells] == ["markdown", "code", "code"]
    assert cells[0]["source"] == "## A title\n\nSome prose."
    assert cells[1]["outputs"][0]["text"] == "" and cells[2]["outputs"][0]["text"] == "x is 5\n"
    assert "The header" not in text and "## A title\n\nSome prose." in text
    assert text.index("```text\nx is 5\n```") < text.index("print(f'x is {x}')")
    assert str(tmp_path) not in text  # no machine's path on a page: a script outside the repository is named alone


def test_a_results_page_prose_line_without_its_mark_says_where(tmp_path):
    from tunix_nb.experiments import __main__ as cli, page

    with pytest.raises(ValueError, match=r"demo\.py, line 3: a prose cell's lines start with '# '"):
        page.read_cells("# %% [markdown]\n# fine\nnot a comment\n", "demo.py")
    with pytest.raises(SystemExit):
        cli.main(["page", str(tmp_path / "missing.py"), "--out", str(tmp_path / "missing.md")])


def test_lesson08s_pilots_score_the_validation_prompts_never_the_test_ones():
    """eval_split=validation (what `pilots.choose` asks of a pilot): every score of the run is on
    the validation prompts; the test prompts are never read."""
    from tunix_nb.experiments import grpo_pass_at_k

    with pytest.raises(ValueError, match="eval_split is 'test' .* or 'validation'"):
        grpo_pass_at_k.GrpoPassAtKConfig(eval_split="train")
    config = grpo_pass_at_k.GrpoPassAtKConfig(steps=2, temperatures=(0.0, 1.0), pass_at_1_samples=2,
                                              pass_at_k_samples=2, ks=(1, 2), eval_split="validation")
    from tunix_nb.experiments import long_family

    # prepare()'s splits and student, without its gate (a pass over the student's answers)
    shared = {"validation": long_family.splits(n_fresh=32)["validation"][:6], "student": long_family.load("student"),
              "test": None}  # a run that reached for the test prompts would fail here
    run = grpo_pass_at_k.run_arm("sft", 0, config, shared)
    assert run["tasks"] == [e["task"] for e in shared["validation"]]
    assert len(run["scores"]) == len(run["greedy"]) == 6 and set(run["validation_pass_at_1"]) == {"0.0", "1.0"}
