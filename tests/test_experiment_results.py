"""The stored multi-seed runs the lessons and the README quote hold what they claim.

Each record in results/ was made by the command it stores; these tests read it back and
assert the issue's targets: a gain's mean, and its 95% interval's lower bound above
zero, over at least five seeds and 1000 test prompts never used for a choice. A target
the stored run misses is marked xfail (strict) with what it measured and why.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tunix_nb.experiments import count_family, gkd_long_answers, grpo_pass_at_k, scarce_labels, stats

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
SIMILARITY = dict(scale=1, decimals=4, unit="")
# (lesson, record, the gain's key path in the summary, how the lesson prints it): every gain a
# lesson's prose quotes, as `stats.describe_gain` prints it
QUOTED_GAINS = [
    ("02_distilling_a_student", "lesson02_distillation_budgets", (scarce_labels.HEADLINE, "distilled_over_labels"), {}),
    ("02_distilling_a_student", "lesson02_distillation_budgets", (scarce_labels.HEADLINE, "soft_over_teacher_labels"),
     {}),
    ("08_grpo", "lesson08_grpo_budgets", ("grpo_over_sft_sampled",), {}),
    ("08_grpo", "lesson08_grpo_budgets", ("grpo_over_sft_greedy",), {}),
    ("08_grpo", "lesson08_grpo_budgets", ("grpo_over_rft_sampled",), {}),
    ("11_on_policy_distillation", "lesson11_gkd", ("on_policy_over_offline_longest_third",), SIMILARITY),
    ("11_on_policy_distillation", "lesson11_gkd", ("exact_match_control",), {}),
    ("11_on_policy_distillation", "lesson11_gkd", ("by_task", "long_reverse", "on_policy_over_offline"), SIMILARITY),
    ("11_on_policy_distillation", "lesson11_gkd", ("by_task", "long_sort", "on_policy_over_offline"), SIMILARITY),
    ("11_on_policy_distillation", "lesson11_gkd_count", ("on_policy_over_offline_longest_third",), SIMILARITY),
    ("11_on_policy_distillation", "lesson11_gkd_count", ("exact_match_control",), {}),
    ("11_on_policy_distillation", "lesson11_gkd_small_student", ("on_policy_over_offline_longest_third",), SIMILARITY),
    ("11_on_policy_distillation", "lesson11_gkd_small_student", ("exact_match_control",), {}),
    ("11_on_policy_distillation", "lesson11_gkd_small_student_1000_steps", ("on_policy_over_offline_longest_third",),
     SIMILARITY),
    ("11_on_policy_distillation", "lesson11_gkd_small_student_1000_steps", ("exact_match_control",), {}),
    ("11_on_policy_distillation", "lesson11_gkd_count14", ("on_policy_over_offline_longest_third",), SIMILARITY),
    ("11_on_policy_distillation", "lesson11_gkd_count14", ("exact_match_control",), {}),
    ("11_on_policy_distillation", "lesson11_count14_pilots/steps_200", ("on_policy_over_offline_longest_third",),
     SIMILARITY),
    ("11_on_policy_distillation", "lesson11_gkd_count14_budgets", ("on_policy_over_offline_longest_third",), SIMILARITY),
    ("11_on_policy_distillation", "lesson11_gkd_count14_budgets", ("exact_match_control",), {}),
]


# A summary sums up to S x N = 5 x 1000 differences (each seed's mean over the prompts, then
# over the seeds), and numpy's pairwise summation may take another order on another
# processor's SIMD width: recomputed there, a figure can move in its last bits. Floats are
# compared to float64's epsilon times the terms summed; everything else must be equal.
SUMMED_TERMS = 5 * 1000
FLOAT64_BOUND = np.finfo(np.float64).eps * SUMMED_TERMS


def assert_same_summary(found, stored, where="summary"):
    found = json.loads(json.dumps(found))
    if isinstance(stored, dict):
        assert isinstance(found, dict) and found.keys() == stored.keys(), where
        for key in stored:
            assert_same_summary(found[key], stored[key], f"{where}.{key}")
    elif isinstance(stored, list):
        assert isinstance(found, list) and len(found) == len(stored), where
        for i, (f, s) in enumerate(zip(found, stored)):
            assert_same_summary(f, s, f"{where}[{i}]")
    elif isinstance(stored, float) and not isinstance(stored, bool):
        assert found == pytest.approx(stored, rel=FLOAT64_BOUND, abs=FLOAT64_BOUND * 1e-3), where
    else:
        assert found == stored, where


def test_summaries_are_compared_exactly_but_for_float64_rounding():
    assert_same_summary({"a": [1, 0.5]}, {"a": [1, 0.5 * (1 + 1e-15)]})
    with pytest.raises(AssertionError, match=r"summary.a\[1\]"):
        assert_same_summary({"a": [1, 0.5]}, {"a": [1, 0.5001]})
    with pytest.raises(AssertionError):
        assert_same_summary({"a": [1, 0.5]}, {"a": [2, 0.5]})


def record(name):
    return json.loads((RESULTS / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def lesson02():
    rec = record("lesson02_distillation_budgets")
    return rec, scarce_labels.summarise(rec)


@pytest.fixture(scope="module")
def lesson08():
    rec = record("lesson08_grpo_budgets")
    return rec, grpo_pass_at_k.summarise(rec)


@pytest.fixture(scope="module")
def lesson11():
    rec = record("lesson11_gkd")
    return rec, gkd_long_answers.summarise(rec)


@pytest.fixture(scope="module")
def lesson11_count():
    """Lesson 11's second design: running counts (`--set family=count`)."""
    rec = record("lesson11_gkd_count")
    return rec, gkd_long_answers.summarise(rec)


@pytest.fixture(scope="module")
def lesson11_small():
    """Lesson 11's third design: running counts with a one-layer student, nearer its floor than the count student."""
    rec = record("lesson11_gkd_small_student")
    return rec, gkd_long_answers.summarise(rec)


@pytest.fixture(scope="module")
def lesson11_small_1000():
    """The third design's second test run: 1000 steps, chosen on validation for the share."""
    rec = record("lesson11_gkd_small_student_1000_steps")
    return rec, gkd_long_answers.summarise(rec)


@pytest.fixture(scope="module")
def lesson11_count14():
    """Lesson 11's fourth design: running counts of exactly 14 bits (`--set family=count14`)."""
    rec = record("lesson11_gkd_count14")
    return rec, gkd_long_answers.summarise(rec)


@pytest.mark.parametrize("name, command", [
    ("lesson02_distillation_budgets", "python -m tunix_nb.experiments lesson02_distillation --seeds 10 "
                                      "--set labelled_pool=2000 --set steps=2400"),
    ("lesson08_grpo_budgets", "python -m tunix_nb.experiments lesson08_grpo --seeds 5 --set steps=600 --set eval_every=100"),
    ("lesson11_gkd", "python -m tunix_nb.experiments lesson11_gkd --seeds 5"),
    ("lesson11_gkd_count", "python -m tunix_nb.experiments lesson11_gkd --seeds 5 --set family=count"),
    ("lesson11_gkd_small_student",
     "python -m tunix_nb.experiments lesson11_gkd --seeds 5 --set family=count --set student=small_student"),
    ("lesson11_gkd_small_student_1000_steps", "python -m tunix_nb.experiments lesson11_gkd --seeds 5 --set "
                                              "family=count --set student=small_student --set steps=1000"),
    ("lesson11_gkd_count14", "python -m tunix_nb.experiments lesson11_gkd --seeds 5 --set family=count14 "
                             "--set steps=120"),
])
def test_each_record_holds_its_seeds_on_1000_test_prompts_and_its_command(name, command):
    """Five seeds, ten for lesson 02 (issue 49: at least 10 where a run is cheap)."""
    rec = record(name)
    n_seeds = int(command.split("--seeds ")[1].split()[0])
    assert rec["command"].startswith(command) and rec["seeds"] == list(range(n_seeds))
    for setting in rec["runs"].values():
        for runs in setting.values():
            assert len(runs) == n_seeds and {len(r["scores"]) for r in runs} == {1000}


def test_the_stored_summary_is_what_the_scores_give(lesson02, lesson08, lesson11, lesson11_count, lesson11_small,
                                                    lesson11_small_1000, lesson11_count14):
    """The summary written beside the runs is recomputed from them, not edited."""
    for rec, summary in (lesson02, lesson08, lesson11, lesson11_count, lesson11_small, lesson11_small_1000,
                         lesson11_count14):
        assert_same_summary(summary, rec["summary"])


def test_lesson02_distillation_beats_hard_labels_by_10_points(lesson02):
    gain = lesson02[1][scarce_labels.HEADLINE]["distilled_over_labels"]
    assert gain["mean"] >= 0.10 and gain["ci95"][0] > 0


def test_lesson02_reports_soft_targets_against_teacher_labels_with_an_interval(lesson02):
    for setting in lesson02[1].values():
        gain = setting["soft_over_teacher_labels"]
        assert gain["ci95"][0] <= gain["mean"] <= gain["ci95"][1]


def test_lesson02_picked_every_reporting_step_on_validation(lesson02):
    rec, _ = lesson02
    for setting in rec["runs"].values():
        for runs in setting.values():
            for run in runs:
                best = max(run["curve"], key=lambda c: c["val_exact_match"])
                assert run["chosen_step"] == best["step"]


def test_lesson08_grpo_beats_the_sft_policy_at_its_best_temperature_by_10_points(lesson08):
    gain = lesson08[1]["grpo_over_sft_sampled"]
    assert gain["mean"] >= 0.10 and gain["ci95"][0] > 0


def test_lesson08_grpo_beats_the_sft_policy_greedy_by_3_points(lesson08):
    gain = lesson08[1]["grpo_over_sft_greedy"]
    assert gain["mean"] >= 0.03 and gain["ci95"][0] > 0


def test_lesson08_temperatures_were_chosen_on_validation(lesson08):
    rec, _ = lesson08
    for runs in rec["runs"]["long"].values():
        for run in runs:
            scores = run["validation_pass_at_1"]
            assert run["best_temperature"] == float(max(scores, key=scores.get))


def test_lesson08_the_student_passes_the_pilot_gate(lesson08):
    gate = lesson08[0]["setup"]["gate"]
    assert 0.30 <= gate["pass_at_1"] <= 0.70
    assert gate["pass_at_8"] - gate["greedy"] >= 0.20


@pytest.mark.xfail(strict=True, reason="missed: on-policy - offline edit similarity on the longest third is -0.0002 "
                   "(95% interval -0.0083 to +0.0051) over 5 seeds; on-policy training lowers the share of errors the "
                   "student's own prefix causes, but raises its errors after the right prefix more (lesson 11)")
def test_lesson11_on_policy_beats_offline_in_edit_similarity_on_the_longest_third(lesson11):
    gain = lesson11[1]["on_policy_over_offline_longest_third"]
    assert gain["mean"] > 0 and gain["ci95"][0] > 0


@pytest.mark.xfail(strict=True, reason="missed: the share falls from 59% (offline) to 45% (on-policy), "
                   "lower on every seed but not half. On reversals it falls from 35% to 6%; on sorts, whose wrong "
                   "answers are nearly all a symbol short or long, from 74% to 71% (lesson 11)")
def test_lesson11_on_policy_halves_the_share_of_errors_its_own_prefix_causes(lesson11):
    share = lesson11[1]["own_prefix_share_longest_third"]
    assert share["on_policy"]["mean"] <= 0.5 * share["offline"]["mean"]


def test_lesson11_on_policy_lowers_the_share_of_errors_its_own_prefix_causes_on_every_seed(lesson11):
    """What on-policy training is for, as measured: lower on each seed, paired."""
    share = lesson11[1]["own_prefix_share_longest_third"]
    assert all(on < off for on, off in zip(share["on_policy"]["per_seed"], share["offline"]["per_seed"]))


def test_lesson11_on_reversals_on_policy_at_least_halves_the_own_prefix_share_on_every_seed(lesson11):
    """Where the student's slips compound (reversals, whose wrong answers keep their length), on-policy
    training removes what it is meant to (lesson 11, "Where the errors are"), seed by seed."""
    share = lesson11[1]["by_task"]["long_reverse"]["own_prefix_share_longest_third"]
    assert all(on <= 0.5 * off for on, off in zip(share["on_policy"]["per_seed"], share["offline"]["per_seed"]))


def test_lesson11_sorts_own_prefix_errors_are_mostly_answers_a_symbol_short_or_long(lesson11):
    """Why the family's share cannot halve (lesson 11): a wrong sort is nearly always one symbol short or
    long, which position-aligned counting charges at every later position, and no arm can undo."""
    sort = lesson11[1]["by_task"]["long_sort"]
    assert min(sort["wrong_answers_of_the_wrong_length"].values()) > 0.9
    assert sort["own_prefix_share_longest_third"]["on_policy"]["mean"] > 0.5 * sort[
        "own_prefix_share_longest_third"]["offline"]["mean"]
    assert positive_seeds(sort["on_policy_over_offline"]) in " ".join(markdown("11_on_policy_distillation").split())


@pytest.mark.xfail(strict=True, reason="missed on the second design too: on running counts (40 steps, chosen on "
                   "validation, where it gave +0.0023 on 2 seeds) on-policy - offline edit similarity on the longest "
                   "third is +0.0006 (95% interval -0.0012 to +0.0022) over 5 seeds (lesson 11)")
def test_lesson11_on_running_counts_on_policy_beats_offline_in_edit_similarity_on_the_longest_third(lesson11_count):
    gain = lesson11_count[1]["on_policy_over_offline_longest_third"]
    assert gain["mean"] > 0 and gain["ci95"][0] > 0


@pytest.mark.xfail(strict=True, reason="missed on the second design too: on running counts the share falls from 49% "
                   "to 42%, not to half (lesson 11)")
def test_lesson11_on_running_counts_on_policy_halves_the_share_of_errors_its_own_prefix_causes(lesson11_count):
    share = lesson11_count[1]["own_prefix_share_longest_third"]
    assert share["on_policy"]["mean"] <= 0.5 * share["offline"]["mean"]


def test_lesson11_on_running_counts_on_policy_corrects_more_miscounts_and_carries_fewer_on_every_seed(lesson11_count):
    """What on-policy training is for, on the count family (lesson 11): right after a slip, the
    on-policy student gives the right digit more often and carries the slip on less often, seed by seed."""
    slip = lesson11_count[1]["after_a_slip"]
    on, off = slip["on_policy"], slip["offline"]
    assert all(a > b for a, b in zip(on["right"]["per_seed"], off["right"]["per_seed"]))
    assert all(a < b for a, b in zip(on["carried"]["per_seed"], off["carried"]["per_seed"]))
    gain = lesson11_count[1]["on_policy_over_offline_longest_third"]
    assert positive_seeds(gain) in " ".join(markdown("11_on_policy_distillation").split())


def test_lesson11_with_a_one_layer_student_on_policy_beats_offline_in_edit_similarity_on_the_longest_third(
        lesson11_small):
    """Lesson 11's target, met on the third design: the mean paired gain over five seeds, its
    interval over the seeds above zero."""
    rec, summary = lesson11_small
    assert rec["config"]["eval_split"] == "test" and rec["config"]["student"] == "small_student"
    gain = summary["on_policy_over_offline_longest_third"]
    assert gain["mean"] > 0 and gain["ci95"][0] > 0
    assert positive_seeds(gain) in " ".join(markdown("11_on_policy_distillation").split())


@pytest.mark.xfail(strict=True, reason="missed on the third design: with the one-layer student the share falls from "
                   "52% to 47%, not to half (within its own answers, an early eos's missing tail left out, 50% to "
                   "43%), which would take removing about two thirds of the errors its own prefix causes; it "
                   "carries a fifth fewer of its own slips on and removes about a fifth. Fifteen more "
                   "validation pilots (more steps, a larger learning rate, T = 0.5 to 2, the forward or reverse KL) "
                   "reach 26% at best, where the gain is gone; from 1000 steps the on-policy share stays at 26-33% "
                   "while offline's is 46% at most (lesson 11)")
def test_lesson11_with_a_one_layer_student_on_policy_halves_the_share_of_errors_its_own_prefix_causes(
        lesson11_small):
    share = lesson11_small[1]["own_prefix_share_longest_third"]
    assert share["on_policy"]["mean"] <= 0.5 * share["offline"]["mean"]


def test_lesson11_with_a_one_layer_student_on_policy_recovers_from_its_own_slips_more_often_on_every_seed(
        lesson11_small):
    """Where the third design's gain comes from: right after its own first wrong digit (free-running,
    `count_family.after_own_slip`) the on-policy student gives the right digit more often and carries
    the slip on less often, seed by seed, over about 250 slips a seed and arm."""
    slip = lesson11_small[1]["after_own_slip"]
    on, off = slip["on_policy"], slip["offline"]
    assert all(a > b for a, b in zip(on["right"]["per_seed"], off["right"]["per_seed"]))
    assert all(a < b for a, b in zip(on["carried"]["per_seed"], off["carried"]["per_seed"]))
    slips = [r["after_own_slip"]["slips"] for arm in ("offline", "on_policy") for r in lesson11_small[0]["runs"]["long"][arm]]
    assert min(slips) >= 200  # enough slips a seed for a share to mean something


def test_lesson11s_1000_step_run_is_the_default_settings_pilot_with_the_lowest_on_policy_share(lesson11_small_1000):
    """Its setting was chosen on validation for lesson 11's second target: among the one-layer
    pilots at the default temperature, divergence and learning rate, the one whose on-policy arm
    left the lowest share of errors caused by its own prefix."""
    defaults = dataclasses.asdict(gkd_long_answers.GkdLongConfig())
    settings = lambda config: {k: v for k, v in {**defaults, **config}.items() if k != "eval_split"}  # noqa: E731
    plain = [pilot for pilot in map(lambda p: json.loads(p.read_text()), SMALL_PILOTS)
             if all(settings(pilot["config"])[k] == defaults[k] for k in ("temperature", "beta", "learning_rate"))]
    assert len(plain) >= 5
    lowest = min(plain, key=lambda p: p["summary"]["own_prefix_share_longest_third"]["on_policy"]["mean"])
    assert settings(lowest["config"]) == settings(lesson11_small_1000[0]["config"])
    assert lesson11_small_1000[0]["config"]["eval_split"] == "test"


def test_lesson11s_1000_step_run_is_positive_on_every_seed_but_its_interval_reaches_below_zero(lesson11_small_1000):
    """One seed's gain is less than half the others': over five seeds that is no win (lesson 11 says so)."""
    gain = lesson11_small_1000[1]["on_policy_over_offline_longest_third"]
    assert min(gain["per_seed"]) > 0 and gain["ci95"][0] < 0 < gain["ci95"][1]
    assert min(gain["per_seed"]) < 0.5 * sorted(gain["per_seed"])[1]
    stated = f"{stats.describe_gain(gain, **SIMILARITY)}**, {positive_seeds(gain)}, but"
    assert stated in " ".join(markdown("11_on_policy_distillation").split())


@pytest.mark.xfail(strict=True, reason="missed at 1000 steps too: the share falls from 48% to 35%. Within the "
                   "student's own answers, an early eos's missing tail left out, it falls from 43% to 24%, not "
                   "to half either (the validation pilot gave 38% to 15%); the missing tails, which on-policy "
                   "training barely moves, are 48% of what the on-policy student's own prefix causes (lesson 11)")
def test_lesson11s_1000_step_run_halves_the_share_of_errors_its_own_prefix_causes(lesson11_small_1000):
    share = lesson11_small_1000[1]["own_prefix_share_longest_third"]
    assert share["on_policy"]["mean"] <= 0.5 * share["offline"]["mean"]


def test_lesson11s_one_layer_runs_leave_more_of_their_own_prefix_errors_in_early_eos_tails_on_policy(
        lesson11_small, lesson11_small_1000):
    """Lesson 11's reading of the share: within its own answers the on-policy student's share
    falls on every seed, and more of what its own prefix causes is the missing tail after an
    early eos, which on-policy training cannot reach, than offline's (seed by seed, both runs)."""
    for _, summary in (lesson11_small, lesson11_small_1000):
        within = summary["own_prefix_share_within_answer_longest_third"]
        tail = summary["tail_part_of_own_prefix_errors_longest_third"]
        assert all(a < b for a, b in zip(within["on_policy"]["per_seed"], within["offline"]["per_seed"]))
        assert all(a > b for a, b in zip(tail["on_policy"]["per_seed"], tail["offline"]["per_seed"]))
    kept = [lesson11_small[0], lesson11_small_1000[0], json.loads(
        (RESULTS / "lesson11_small_student_pilots" / "steps_1000.json").read_text())]
    for run in [run for rec in kept for runs in rec["runs"]["long"].values() for run in runs]:
        counts = run["errors_by_own_end"]  # the split adds up to the headline's token errors, run by run
        free = counts["within"]["free_running"] + counts["after_end"]["free_running"]
        forced = counts["within"]["teacher_forced"] + counts["after_end"]["teacher_forced"]
        assert run["own_prefix_share"] == pytest.approx((free - forced) / free)


def test_lesson11_on_counts_of_one_length_on_policy_beats_offline_in_edit_similarity(lesson11_count14):
    """Lesson 11's first target, on the fourth design (every answer has 14 digits, so the
    longest third is every answer)."""
    rec, summary = lesson11_count14
    assert rec["config"]["eval_split"] == "test" and rec["config"]["family"] == "count14"
    gain = summary["on_policy_over_offline_longest_third"]
    assert gain["mean"] > 0 and gain["ci95"][0] > 0
    stated = f"{stats.describe_gain(gain, **SIMILARITY)}**, {positive_seeds(gain)}"
    assert stated in " ".join(markdown("11_on_policy_distillation").split())


def test_lesson11_on_counts_of_one_length_on_policy_halves_the_share_of_errors_its_own_prefix_causes(
        lesson11_count14):
    """Lesson 11's second target, met on the fourth design: over the five seeds' mean, and on
    every seed against its own offline arm."""
    share = lesson11_count14[1]["own_prefix_share_longest_third"]
    assert share["on_policy"]["mean"] <= 0.5 * share["offline"]["mean"]
    assert all(on <= 0.5 * off for on, off in zip(share["on_policy"]["per_seed"], share["offline"]["per_seed"]))


def test_lesson11_on_counts_of_one_length_almost_every_answer_has_14_digits(lesson11_count14):
    """What the fourth design was built for: with one length, no offline answer ends before
    its 14th digit; in either arm at most 1% of the answers a seed have another length, and
    the missing tails of those that stop early are at most 5 digits a seed (of 14,000), so
    the errors the own prefix causes are slips carried on."""
    runs = lesson11_count14[0]["runs"]["long"]
    assert all(run["errors_by_own_end"]["after_end"]["free_running"] == 0 for run in runs["offline"])
    for run in runs["offline"] + runs["on_policy"]:
        assert run["errors_by_own_end"]["after_end"]["free_running"] <= 5
        assert np.mean(np.array(run["own_length"]) != 14) <= 0.01


def test_lesson11_on_counts_of_one_length_on_policy_corrects_its_own_slips_not_planted_ones(lesson11_count14):
    """Where the fourth design's gain comes from, seed by seed: after its own first slip the
    on-policy student gives the right digit far more often than offline, which carries
    nearly every slip on; a slip planted one too high both carry on nearly always (lesson 11)."""
    summary = lesson11_count14[1]
    own, planted = summary["after_own_slip"], summary["after_a_slip"]
    assert all(on >= off + 0.5 for on, off in zip(own["on_policy"]["right"]["per_seed"],
                                                  own["offline"]["right"]["per_seed"]))
    assert own["offline"]["carried"]["mean"] >= 0.9
    assert min(planted[arm]["carried"]["mean"] for arm in planted) >= 0.9


def test_lesson11_on_counts_of_one_length_offline_learns_the_local_rule_by_200_steps():
    """The fourth design's step pilots, as lesson 11 reads them: on-policy's gain peaks where
    the offline student still carries every slip of its own on, and by 200 steps the offline
    student makes almost no error at all (it no longer slips, though it would still carry a
    planted slip on: the local rule, learnt exactly) while the on-policy one keeps its slips
    and loses."""
    records = {int(p.stem.removeprefix("steps_")): json.loads(p.read_text()) for p in COUNT14_PILOTS}
    pilots = {steps: rec["summary"] for steps, rec in records.items()}
    assert sorted(pilots) == [40, 80, 120, 160, 200]
    best = max(pilots.values(), key=lambda s: s["on_policy_over_offline_longest_third"]["mean"])
    assert best["after_own_slip"]["offline"]["carried"]["mean"] == 1.0
    late = pilots[200]
    assert sum(r["after_own_slip"]["slips"] for r in records[200]["runs"]["long"]["offline"]) <= 2
    assert late["after_a_slip"]["offline"]["carried"]["mean"] >= 0.9
    assert late["free_running_error_longest_third"]["offline"]["mean"] < 0.001
    assert late["teacher_forced_error_longest_third"]["on_policy"] > 0.02
    assert late["on_policy_over_offline_longest_third"]["ci95"][1] < 0


COUNT_PILOTS = sorted((RESULTS / "lesson11_count_pilots").glob("*.json"))
SMALL_PILOTS = sorted((RESULTS / "lesson11_small_student_pilots").glob("*.json"))
COUNT14_PILOTS = sorted((RESULTS / "lesson11_count14_pilots").glob("*.json"))
# each count-family design's pilots: (their folder, the flags their command starts with)
COUNT_DESIGNS = {"lesson11_count_pilots": "--set family=count --set eval_split=validation",
                 "lesson11_small_student_pilots":
                     "--set family=count --set student=small_student --set eval_split=validation",
                 "lesson11_count14_pilots": "--set family=count14 --set eval_split=validation"}


@pytest.mark.parametrize("path", COUNT_PILOTS + SMALL_PILOTS + COUNT14_PILOTS,
                         ids=[f"{p.parent.name}-{p.stem}" for p in COUNT_PILOTS + SMALL_PILOTS + COUNT14_PILOTS])
def test_lesson11_count_pilots_were_scored_on_validation_with_their_command(path):
    pilot = json.loads(path.read_text())
    family = "count14" if path.parent.name == "lesson11_count14_pilots" else "count"
    assert pilot["config"]["eval_split"] == "validation" and pilot["config"]["family"] == family, path.name
    assert COUNT_DESIGNS[path.parent.name] in pilot["command"] and (
        f"--out results/{path.parent.name}/{path.name}" in pilot["command"]), f"{path.name}: its command"
    assert_same_summary(gkd_long_answers.summarise(pilot), pilot["summary"])


@pytest.mark.parametrize("pilots, design, at_least", [(COUNT_PILOTS, "lesson11_count", 6),
                                                       (SMALL_PILOTS, "lesson11_small", 2),
                                                       (COUNT14_PILOTS, "lesson11_count14", 5)])
def test_lesson11s_count_designs_are_the_validation_pilots_with_the_largest_gain(pilots, design, at_least, request):
    """Each stored test run's settings were chosen on validation: the pilot whose gain was largest."""
    stored = request.getfixturevalue(design)[0]
    pilots = [json.loads(p.read_text()) for p in pilots]
    assert len(pilots) >= at_least
    best = max(pilots, key=lambda p: p["summary"]["on_policy_over_offline_longest_third"]["mean"])
    # a record made before a config field existed ran with that field's default
    defaults = dataclasses.asdict(gkd_long_answers.GkdLongConfig())
    settings = lambda config: {k: v for k, v in {**defaults, **config}.items() if k != "eval_split"}  # noqa: E731
    assert settings(best["config"]) == settings(stored["config"])


def test_lesson11_count_pilots_that_correct_more_slips_err_more_after_the_right_prefix():
    """Lesson 11's reading of the count pilots: what on-policy training corrects (fewer slips
    carried on) rises with what it costs (teacher-forced error), pilot by pilot."""
    pairs = [count_family.correction_and_cost(json.loads(p.read_text())["summary"]) for p in COUNT_PILOTS]
    assert len(pairs) >= 12
    rho = stats.rank_correlation([p["corrected"] for p in pairs], [p["cost"] for p in pairs])
    assert rho >= 0.5, f"rank correlation {rho:.2f}: lesson 11 says the two rise together"
    assert f"rank correlation {rho:.2f}" in " ".join(markdown("11_on_policy_distillation").split())


COUNT_DIAGNOSTICS = sorted((RESULTS / "lesson11_count_diagnostics").glob("*.json"))


def test_lesson11s_diagnostic_arms_corrections_taught_offline_cost_right_prefixes():
    """Lesson 11's diagnostic: offline arms taught corrections without sampling (their answer
    inputs swapped), and their untaught controls (the same rows, nothing after a swap in the
    loss), on validation beside the chosen pilot, whose on-policy arm they repeat exactly.
    Taught: the more swapped, the fewer slips carried on and the more errors after the right
    prefix. Untaught: no fewer slips carried on, yet much of the same price."""
    chosen = json.loads((RESULTS / "lesson11_count_pilots" / "steps_40.json").read_text())
    without_seconds = lambda runs: [{k: v for k, v in r.items() if k != "seconds"} for r in runs]  # noqa: E731
    plain = count_figures(chosen["summary"])
    arms = {}
    for path in COUNT_DIAGNOSTICS:
        record = json.loads(path.read_text())
        config = dict(record["config"])
        rate, taught = config.pop("offline_slip_rate"), config.pop("offline_slip_taught")
        assert rate > 0 and config == chosen["config"], f"{path.name}: the chosen pilot's settings, on validation"
        assert (f"--set offline_slip_rate={rate}" + ("" if taught else " --set offline_slip_taught=false")
                + f" --out results/lesson11_count_diagnostics/{path.name}") in record["command"]
        assert without_seconds(record["runs"]["long"]["on_policy"]) == without_seconds(chosen["runs"]["long"]["on_policy"])
        assert_same_summary(gkd_long_answers.summarise(record), record["summary"])
        arms[rate, taught] = count_figures(record["summary"])
    assert sorted(arms) == [(0.1, False), (0.1, True), (0.3, False), (0.3, True)]
    taught = [plain, arms[0.1, True], arms[0.3, True]]
    assert [a["carried"] for a in taught] == sorted((a["carried"] for a in taught), reverse=True)
    assert [a["forced"] for a in taught] == sorted(a["forced"] for a in taught)
    for rate in (0.1, 0.3):
        untaught, cost = arms[rate, False], arms[rate, True]["forced"] - plain["forced"]
        assert abs(untaught["carried"] - plain["carried"]) < 0.03, f"rate {rate}: untaught rows correct nothing"
        assert untaught["forced"] - plain["forced"] >= 0.4 * cost > 0, f"rate {rate}: much of the same price"


def count_figures(summary: dict) -> dict:
    """The offline arm's slips carried on and error after the right prefix."""
    return {"carried": summary["after_a_slip"]["offline"]["carried"]["mean"],
            "forced": summary["teacher_forced_error_longest_third"]["offline"]}


def test_the_datasheet_quotes_the_count_checkpoints_validation_exact_match(lesson11_count):
    em = lesson11_count[0]["setup"]["validation_exact_match"]
    rows = {line.split("|")[1].strip(): line for line in (ROOT / "data" / "README.md").read_text().splitlines()
            if line.startswith("| `count_")}
    assert f"validation exact match {em['teacher']:.1%}" in rows["`count_teacher/`"]
    assert f"validation exact match {em['student']:.1%}" in rows["`count_student/`"]



def test_the_datasheet_quotes_the_small_students_validation_exact_match(lesson11_small):
    em = lesson11_small[0]["setup"]["validation_exact_match"]["student"]
    row = next(line for line in (ROOT / "data" / "README.md").read_text().splitlines()
               if line.startswith("| `count_small_student/`"))
    assert f"validation exact match {em:.1%}" in row


def test_the_datasheet_quotes_the_count14_students_validation_exact_match(lesson11_count14):
    em = lesson11_count14[0]["setup"]["validation_exact_match"]["student"]
    row = next(line for line in (ROOT / "data" / "README.md").read_text().splitlines()
               if line.startswith("| `count14_student/`"))
    assert f"validation exact match {em:.1%}" in row


def positive_seeds(gain: dict) -> str:
    """How the lesson words a five-seed gain's sign count: "positive on three seeds of five"."""
    positive = sum(g > 0 for g in gain["per_seed"])
    if positive == len(gain["per_seed"]) == 5:
        return "positive on all five seeds"
    return f"positive on {['no', 'one', 'two', 'three', 'four'][positive]} seeds of five"


# a lesson -> its results page, where its design search lives (docs/lesson11_designs.md)
RESULTS_PAGES = {"11_on_policy_distillation": ROOT / "docs" / "lesson11_designs.md"}
PAGE_OUTPUTS = re.compile(r"```text\n.*?```|<details>.*?</details>", re.S)  # what the page printed, not its prose


def markdown(notebook: str) -> str:
    """The lesson's prose, and its results page's prose where it has one."""
    cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    page = RESULTS_PAGES.get(notebook)
    return prose + ("\n" + PAGE_OUTPUTS.sub(" ", page.read_text()) if page else "")


@pytest.mark.parametrize("notebook, name, path, style", QUOTED_GAINS,
                         ids=[f"{nb[:2]}-{'.'.join(path)}" for nb, _, path, _ in QUOTED_GAINS])
def test_the_lessons_prose_quotes_the_stored_gains(notebook, name, path, style):
    gain = record(name)["summary"]
    for key in path:
        gain = gain[key]
    quoted = stats.describe_gain(gain, **style)
    assert " ".join(quoted.split()) in " ".join(markdown(notebook).split()), (
        f"notebooks/{notebook}.ipynb's prose should quote {quoted!r} (results/{name}.json)")


def test_the_datasheet_quotes_the_stored_pilot_gate():
    gate = record("lesson08_grpo_budgets")["setup"]["gate"]
    sheet = " ".join((ROOT / "data" / "README.md").read_text().split())
    assert (f"greedy {gate['greedy']:.1%}, sampled pass@1 {gate['pass_at_1']:.1%}" in sheet
            and f"pass@8 {gate['pass_at_8']:.1%}, {100 * (gate['pass_at_8'] - gate['greedy']):.1f} points above greedy"
            in sheet), "data/README.md's long_student row should quote the gate in results/lesson08_grpo_budgets.json"


PILOTS = sorted((RESULTS / "lesson11_pilots").glob("*.json"))


@pytest.mark.parametrize("path", PILOTS, ids=[p.stem for p in PILOTS])
def test_lesson11_pilots_were_scored_on_validation_with_their_command_and_are_what_the_lesson_says(path):
    pilot = json.loads(path.read_text())
    assert pilot["config"]["eval_split"] == "validation", f"{path.name}: a design is tried on validation, never on test"
    assert "--set eval_split=validation" in pilot["command"] and f"--out results/lesson11_pilots/{path.name}" in pilot[
        "command"], f"{path.name} should store the command that made it"
    found = gkd_long_answers.summarise(pilot)
    assert_same_summary(found, pilot["summary"])
    # lesson 11: every variant lowered the own-prefix share, none beat offline (no interval above zero)
    shares = found["own_prefix_share_longest_third"]
    assert shares["on_policy"]["mean"] < shares["offline"]["mean"]
    reverse = found["by_task"]["long_reverse"]  # and on reversals: the share falls, the right-prefix error rises
    assert reverse["own_prefix_share_longest_third"]["on_policy"]["mean"] < reverse[
        "own_prefix_share_longest_third"]["offline"]["mean"]
    assert reverse["teacher_forced_error_longest_third"]["on_policy"] > reverse["teacher_forced_error_longest_third"][
        "offline"]
    gain = found["on_policy_over_offline_longest_third"]
    assert gain["ci95"][0] <= 0, f"{path.name}: a design that beats offline on validation is one to run on test"
    if gain["mean"] > 0 or gain["ci95"][1] < 0:  # the lesson names every mean above zero or interval below it
        assert f"{gain['mean']:+.4f}" in markdown("11_on_policy_distillation"), path.name


def test_there_are_lesson11_pilots():
    assert len(PILOTS) >= 8


@pytest.mark.parametrize("folder, pattern, field", [("lesson02_pilots", "labels_300_lr_*.json", "learning_rate"),
                                                    ("lesson11_budget_pilots", "count14_lr_*.json", "learning_rate"),
                                                    ("lesson08_pilots", "lr_*.json", "learning_rate,rft_learning_rate")])
def test_the_rerun_pilots_readme_quotes_what_choose_gives(folder, pattern, field):
    """Each table row of the pilots' README: the arm's mean validation score at each rate, to 4
    places, and the chosen rate starred, as `pilots.choose` computes them from the records."""
    from tunix_nb.experiments import pilots

    records = [json.loads(p.read_text()) for p in sorted((RESULTS / folder).glob(pattern))]
    assert len(records) >= 3, f"results/{folder}/{pattern}: a grid of at least three rates"
    choice = pilots.choose(records, field)
    readme = (RESULTS / folder / "README.md").read_text()
    for arms in choice.values():
        for arm, c in arms.items():
            row = next(line for line in readme.splitlines() if line.startswith(f"| {arm} |"))
            for value, s in c["by_value"].items():
                assert f"{s['mean']:.4f}" + (" *" if value == c["chosen"] else " |") in row, (arm, value)


def test_lesson11s_budget_fair_test_run_is_what_its_readme_says():
    """The 10-seed count14 run at each arm's own best validation checkpoint: the gain and its
    seed-level interval that results/lesson11_budget_pilots/README.md quotes."""
    record = json.loads((RESULTS / "lesson11_gkd_count14_budgets.json").read_text())
    runs = record["runs"]["long"]
    assert record["config"]["eval_split"] == "test" and record["config"]["eval_every"] == 40 and len(record["seeds"]) == 10
    per_seed = lambda key: (np.array([r[key] for r in runs["on_policy"]]) - np.array([r[key] for r in runs["offline"]])).mean(1)  # noqa: E731
    readme = (RESULTS / "lesson11_budget_pilots" / "README.md").read_text()
    similarity, exact = stats.seed_interval(per_seed("scores")), stats.seed_interval(per_seed("exact_match"))
    assert (f"mean {similarity['mean']:.4f}, median {similarity['median']:.4f}" in readme
            and f"{similarity['ci95'][0]:.4f} to {similarity['ci95'][1]:.4f}" in readme)
    assert f"{exact['mean']:.4f} ({exact['ci95'][0]:.4f} to {exact['ci95'][1]:.4f})" in readme
    assert all(r["chosen_step"] in (120, 160) for r in runs["offline"])
    assert {r["chosen_step"] for r in runs["on_policy"]} <= set(range(200, 321, 40))


@pytest.mark.parametrize("steps", [1200, 2400])
def test_lesson02s_longer_pilots_are_what_their_readme_says(steps):
    record = json.loads((RESULTS / "lesson02_pilots" / f"labels_300_chosen_lr_{steps}_steps.json").read_text())
    assert record["config"]["steps"] == steps and record["config"]["eval_split"] == "validation"
    readme = (RESULTS / "lesson02_pilots" / "README.md").read_text()
    table = readme.split(f"chosen step of {steps:,}):")[1]  # the table after its heading
    for arm, runs in record["runs"]["labels=300"].items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {arm} ("))
        cells = " | ".join(f"{np.mean(r['scores']):.4f}" for r in runs)
        steps = ", ".join(str(r["chosen_step"]) for r in runs)
        assert f"| {cells} | {steps} |" in row, arm


def test_lesson11_at_each_arms_best_budget_offline_is_ahead_and_on_policy_only_faster_to_096():
    """What lesson 11 says of the budget-fair run: the interval of on-policy - offline lies below
    zero, and on validation on-policy reaches 0.96 first on every seed, offline 0.999 first."""
    from tunix_nb.experiments import pilots

    record = json.loads((RESULTS / "lesson11_gkd_count14_budgets.json").read_text())
    gain = gkd_long_answers.summarise(record)["on_policy_over_offline_longest_third"]
    assert gain["seeds"] == 10 and gain["ci95"][1] < 0
    first = {(arm, t): pilots.steps_to_reach(record, arm, t) for arm in ("offline", "on_policy") for t in (0.96, 0.999)}
    assert all(o < f for o, f in zip(first["on_policy", 0.96], first["offline", 0.96]))
    assert all(f < o for o, f in zip(first["on_policy", 0.999], first["offline", 0.999]))


def test_lesson08_rft_beats_grpo_in_sampled_pass_at_1(lesson08):
    """Lesson 08: rejection-sampling fine-tuning does better than GRPO, an interval over five seeds below zero."""
    gain = lesson08[1]["grpo_over_rft_sampled"]
    assert gain["seeds"] == 5 and gain["ci95"][1] < 0


LESSON08_PILOTS = sorted((RESULTS / "lesson08_pilots").glob("lr_*.json"))


def test_lesson08s_pilots_are_what_their_readme_says():
    """results/lesson08_pilots/README.md's readings: scored on validation with their command; 29 of
    the 30 trained runs peak at the end of 600 steps (the budget is the limit); every policy's best
    temperature but a collapsed one's is 0, 0.05 or 0.1, and those three lie within 0.01 of each other."""
    readme = " ".join((RESULTS / "lesson08_pilots" / "README.md").read_text().split())
    trained, at_the_end = 0, 0
    for path in LESSON08_PILOTS:
        record = json.loads(path.read_text())
        assert record["config"]["eval_split"] == "validation" and f"--out results/lesson08_pilots/{path.name}" in record["command"]
        for arm, runs in record["runs"]["long"].items():
            for run in runs:
                low = [run["validation_pass_at_1"][t] for t in ("0.0", "0.05", "0.1")]
                assert max(low) - min(low) < 0.01, (path.name, arm)
                collapsed = max(run["validation_pass_at_1"].values()) < 0.05  # GRPO at 1e-2
                assert run["best_temperature"] in (0.0, 0.05, 0.1) or collapsed, (path.name, arm)
                if arm != "sft":
                    curve = [point["val_pass_at_1_t1"] for point in run["curve"]]
                    trained += 1
                    at_the_end += run["chosen_step"] == 600 and curve[-1] > curve[-2]
    assert (trained, at_the_end) == (30, 29)
    assert "Of the 30 GRPO and RFT runs (5 rates, 3 seeds), 29 score best on validation at step 600" in readme


def test_lesson08s_test_run_uses_the_pilots_choices_and_the_lesson_reads_its_curves_as_they_are(lesson08):
    """The five-seed test run: each arm at the learning rate its validation pilots chose, scored at
    its best validation checkpoint, its temperature chosen inside a grid that reaches greedy; and
    lesson 08's reading of the curves: GRPO ahead on validation at steps 100 and 200, RFT from 300
    on, every run best at its last checkpoint (the budget is the limit)."""
    from tunix_nb.experiments import pilots

    rec, _ = lesson08
    choice = pilots.choose([json.loads(p.read_text()) for p in LESSON08_PILOTS], "learning_rate,rft_learning_rate")
    [arms] = choice.values()
    # the pilots varied both rates together ("3e-4/3e-4"): each arm's own rate is its field's
    assert rec["config"]["learning_rate"] == float(arms["grpo"]["chosen"].split("/")[0])
    assert rec["config"]["rft_learning_rate"] == float(arms["rft"]["chosen"].split("/")[1])
    assert rec["config"]["eval_split"] == "test" and rec["config"]["steps"] == 600 and len(rec["seeds"]) == 5
    grid = rec["config"]["temperatures"]
    assert min(grid) == 0.0  # greedy: the limit of lowering the temperature
    means = {}
    for arm, runs in rec["runs"]["long"].items():
        assert all(run["best_temperature"] < max(grid) for run in runs), arm
        if arm == "sft":
            continue
        for run in runs:
            best = max(run["curve"], key=lambda c: c["val_pass_at_1_t1"])
            assert run["chosen_step"] == best["step"] == 600, arm
        means[arm] = np.mean([[c["val_pass_at_1_t1"] for c in run["curve"]] for run in runs], axis=0)
    assert list(means["grpo"] > means["rft"]) == [True, True, False, False, False, False]
