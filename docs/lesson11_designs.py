"""Lesson 11's design search, the results page docs/lesson11_designs.md: remade from the stored
records by `python -m tunix_nb.experiments page docs/lesson11_designs.py --out docs/lesson11_designs.md`."""

# %% [markdown]
# # Lesson 11's design search: where on-policy distillation should pay
#
# [Lesson 11](../notebooks/11_on_policy_distillation.ipynb) builds on-policy distillation (GKD)
# and compares it with offline distillation on one task, counts of one length, each arm at
# its own best budget. This page is how that task was found: four designs, each tried first
# in pilots on the validation split, then run on five seeds on the test prompts, with every
# reading kept, the ones that found no gain too. Every table below is printed from the
# stored records in `results/`; each record holds the command that made it.
#
# The argument for on-policy training is about *compounding*. Trained only on right
# prefixes, a student that slips once meets prefixes it never saw, and can slip again;
# trained on its own prefixes, it learns what to do there. DAgger's bound (Ross et al.,
# 2011) puts the offline error at O(T²ε) against O(Tε) for on-policy training over T steps:
# a prediction that the gain grows with the answer's length, not a measured law. Every
# design compares two arms fair in everything but where the prefixes come from: the same
# teacher, the same divergence (JSD(0.5) alone, alpha = 1), the same number of teacher
# forward passes over rows of the same length. Exact match cannot see what on-policy
# training fixes (once an answer is wrong, a second error changes nothing), so the
# measure is **edit similarity** (1 - Levenshtein distance / the longer length), with
# exact match as a control, and the **share of errors the student's own prefix causes**:
# its token error when it runs on its own prefix, less its error after the right one, over
# the first (`evaluate.errors_by_position`, built in the lesson).
#
# A gain is the mean paired difference over seeds, its interval a 95% t-interval over the
# seeds' gains, corrected for their skew (`stats.seed_interval`); the seeds vary the data
# order and the sampling keys, and the test prompts are fixed.
#
# ## The first design: long answers
#
# The kit's **long family** (reverse or sort 6 to 14 symbols;
# `tunix_nb.experiments.long_family`), from the partially competent student lesson 08
# starts from, with a teacher trained on the family. The stored run trains both arms for
# 200 steps on five seeds and scores the 1000 test prompts; it was made by
#
# ```bash
# python -m tunix_nb.experiments lesson11_gkd --seeds 5 --out results/lesson11_gkd.json
# ```

# %%
import json

import numpy as np

from tunix_nb import data, evaluate, model
from tunix_nb.experiments import count14_family, count_family, gkd_long_answers, long_family, stats
from tunix_nb.tokenizer import ByteTokenizer

tok = ByteTokenizer()
RESULTS = data.DATA_DIR.parent / "results"

def pilot_summaries(folder):  # (config, summary) of each validation pilot stored in results/<folder>/
    records = [json.loads(path.read_text()) for path in sorted((RESULTS / folder).glob("*.json"))]
    return [(record["config"], record["summary"]) for record in records]
similarity = lambda g: stats.describe_gain(g, scale=1, decimals=4, unit="")  # noqa: E731

def show_headline(summary):
    for arm in gkd_long_answers.ARMS:
        print(f"{arm:10} edit similarity (longest third) {summary['edit_similarity_longest_third'][arm]['mean']:.4f}; "
              f"free-running token error {summary['free_running_error_longest_third'][arm]['mean']:.2%}, teacher-forced "
              f"{summary['teacher_forced_error_longest_third'][arm]:.2%}; own-prefix share "
              f"{summary['own_prefix_share_longest_third'][arm]['mean']:.0%}")
    print("on-policy - offline, edit similarity, longest third:", similarity(summary["on_policy_over_offline_longest_third"]))
    print("on-policy - offline, edit similarity, all answers:  ", similarity(summary["on_policy_over_offline_all"]))
    print("on-policy - offline, exact match (the control):     ", stats.describe_gain(summary["exact_match_control"]))

record = json.loads((RESULTS / "lesson11_gkd.json").read_text())
summary = record["summary"]  # gkd_long_answers.summarise(record), stored (tests/test_experiment_results.py recomputes it)
show_headline(summary)


# %% [markdown]
# **What five seeds show.** (The run's length was fixed before it ran.) On the longest third of the test answers, on-policy
# distillation's edit similarity differs from offline distillation's by **-0.0002 (95% interval -0.0083 to +0.0051)**: no
# gain, and the interval covers zero. Exact match, the control, moves by **-4.3 points (95% interval -5.2 to -3.3)**:
# on-policy is worse. The share of the student's free-running errors that its own earlier
# tokens caused fell from 59% to 45%, on every seed, but its errors after the *right*
# prefix rose (teacher-forced 3.28% → 4.62%), and its free-running error with them (7.97%
# offline, 8.35% on-policy).
#
# ## Where the errors are: the two sub-tasks apart
#
# The family mixes two sub-tasks whose errors look nothing alike, so the stored runs keep
# each answer's sub-task, its edit distance from the right answer and its length, and the
# error counts of the longest third split by sub-task (`gkd_long_answers.by_task_summary`;
# the wrong answers' figures are pooled over seeds, with no interval):

# %%
for task, t in summary["by_task"].items():
    share, forced = t["own_prefix_share_longest_third"], t["teacher_forced_error_longest_third"]
    free = t["free_running_error_longest_third"]
    edits, shifted = t["edits_per_wrong_answer"], t["wrong_answers_of_the_wrong_length"]
    print(f"{task}, longest third (offline -> on-policy):")
    print(f"  edit similarity {similarity(t['on_policy_over_offline'])}; exact match {stats.describe_gain(t['exact_match'])}")
    print(f"  own-prefix share {share['offline']['mean']:.0%} -> {share['on_policy']['mean']:.0%}; token error after the "
          f"right prefix {forced['offline']:.2%} -> {forced['on_policy']:.2%}, free-running "
          f"{free['offline']['mean']:.2%} -> {free['on_policy']['mean']:.2%}")
    print(f"  wrong answers: {edits['offline']:.1f} -> {edits['on_policy']:.1f} edits each; "
          f"{shifted['offline']:.0%} -> {shifted['on_policy']:.0%} a symbol short or long")

# %% [markdown]
# **Reversals: on-policy training does what it is for, and pays for it.** The offline
# student's slips in a reversal compound: 35% of its free-running errors there come from its
# own earlier tokens. On-policy training removes most of them: 6%, on every seed
# (`tests/test_experiment_results.py` asserts at most half of offline's on each). That part
# of the DAgger argument holds; its conclusion, a lower total error, does not: its errors after the *right* prefix rise from 4.12%
# to 6.62% of tokens, more than the compounding it removed, so its edit similarity falls
# (-0.0083 (95% interval -0.0154 to -0.0014), an interval below zero) and its exact match falls
# much more (-17.5 points (95% interval -20.3 to -14.6)). It has learnt to continue its own prefixes, and lost
# some of what it knew after right ones. The greedy roll-outs below (no sampling at all)
# do the same on the validation split, so sampling alone does not explain it.
#
# **Sorts: most wrong answers have the wrong length, which position-aligned counting
# charges again and again.** 94% of the offline student's wrong long sorts are shorter or
# longer than the right answer: every token after the first missing or extra one is then
# out of place, and
# position-aligned counting (`errors_by_position`) charges an error at each of them. No
# student can undo that after the slip, so the sort share (74% → 71%) barely moves, and it
# keeps the family's share well above half of offline's. Edit distance counts each missing
# or extra symbol once: on-policy's wrong answers are fewer edits from right (3.1 → 2.6 on
# average) and the edit similarity
# gain is +0.0075 (95% interval -0.0016 to +0.0126), positive on four seeds of five but an interval that covers zero.
#
# So on this family the method's effect is real where errors compound (reversals), and
# smaller than its cost; with answers this short and a teacher that is almost
# always right, the offline student's slips do not compound enough for the trade to pay.
# DAgger's T² is a worst-case bound, and this task does not reach it.

# %% [markdown]
# **What else was tried**, on the validation split, never on the test prompts: eight other
# designs, two seeds each, every one against its own offline arm (`results/lesson11_pilots/`,
# each record with the command that made it, e.g.
# `python -m tunix_nb.experiments lesson11_gkd --seeds 2 --set eval_split=validation --set lmbda=0.5 --out results/lesson11_pilots/mixed_half.json`):
# mixing the two kinds of batch (lmbda = 0.5), sampling cooler (T = 0.5), the mixture
# with twice the steps, a quarter of the steps (50), and a warm start (`--set offline_first=150 --set steps=150`): 150
# steps of offline distillation that both arms share, then 150 steps of each, so that the
# on-policy arm samples from a student that is already right on most tokens, as GKD's
# students, fine-tuned first, are. Then three more, after the sub-task figures above:
# greedy roll-outs (`--set temperature=0.0`: DAgger's deterministic student, whose prefixes
# are exactly those its greedy answers meet), and the two other divergences for both arms,
# forward KL (`--set beta=0.0`) and reverse KL (`--set beta=1.0`, the divergence of
# MiniLLM's on-policy distillation).

# %%
print(f"{'design (validation split, 2 seeds)':40}{'on-policy - offline, edit similarity':>48}  own-prefix share"
      "  reversals: own-prefix share, error after the right prefix")
for config, found in pilot_summaries("lesson11_pilots"):
    shares = found["own_prefix_share_longest_third"]
    reverse = found["by_task"]["long_reverse"]
    reverse_share, reverse_forced = reverse["own_prefix_share_longest_third"], reverse["teacher_forced_error_longest_third"]
    design = f"lmbda {config['lmbda']}, T {config['temperature']}, β {config['beta']}, {config['steps']} steps"
    if config["offline_first"]:  # a warm start both arms share
        design = f"{config['offline_first']} offline steps, then {config['steps']}"
    print(f"{design:40}{similarity(found['on_policy_over_offline_longest_third']):>48}  "
          f"{shares['offline']['mean']:.0%} -> {shares['on_policy']['mean']:.0%}    "
          f"{reverse_share['offline']['mean']:.0%} -> {reverse_share['on_policy']['mean']:.0%}, "
          f"{reverse_forced['offline']:.2%} -> {reverse_forced['on_policy']:.2%}")

# %% [markdown]
# Every on-policy variant again lowered the share of errors caused by the student's own
# prefix, and none beat offline distillation in edit similarity: no interval lies above
# zero, and only two means are above it: the mixture with twice the steps (+0.0002), where both
# arms are near the ceiling, and the short run (+0.0008), whose interval is the widest.
# Sampling cooler is worse (-0.0036, its interval below zero, on two seeds); reverse KL
# (-0.0066) and forward KL (-0.0068) lose more on average, with intervals that two seeds
# leave wide, and greedy roll-outs are no better (-0.0018).
# In all eight the reversals repeat the stored run's pattern: the share of errors the
# student's own prefix causes falls, and the error after the right prefix rises.
# Where the effect should appear is where offline students drift further than a reversal
# of 14 symbols lets them: answers of hundreds of tokens (worked traces, reasoning), or a
# task whose every token depends on the ones before it. The next section tries the second.

# %% [markdown]
# ## A second design: running counts, where a slip is carried on
#
# The reversal student recovers after most of its slips: it finds each symbol by its
# position, so a wrong symbol does not move the next one. DAgger's compounding needs a
# student whose next token depends on its own last one. The count family
# (`data.generate_sft(n, seed, family="count")`) is built for that: for 6 to 14 bits, answer
# digit i is the number of 1s among the first i bits, mod 10 (`cnt 1011=` → `1123`). Each
# digit is the one before it plus the next bit, a local rule that a student trained on right
# prefixes can learn, and that carries a miscount into every later digit. Its two
# checkpoints (`data/count_student`, `data/count_teacher`; data/README.md):
#
# - the student: plain SFT, stopped early (step 280) so that it still slips;
# - the teacher: SFT with a tenth of its answer inputs swapped for another digit of the
#   row, the targets kept right (`long_family.with_wrong_prefixes`), so that after a wrong
#   digit it has learnt to give the right next one, not the slip carried on.
#
# What each does right after a slip, built here: teacher-forced on every validation answer
# with one digit made one too high, is the next digit the right one (it counts from the
# input) or the slip plus the next bit (it carried the slip on)?

# %%
from tunix_nb.experiments import count_family
count_models = {"count student": count_family.load("student"), "count teacher": count_family.load("teacher")}
validation = count_family.splits()["validation"]
rng = np.random.default_rng(0)
slip_at = [int(rng.integers(0, len(e["completion"]) - 1)) for e in validation]  # never the last digit

def with_slip(e, k):  # the right answer with digit k one too high: a miscount
    wrong = str((int(e["completion"][k]) + 1) % 10)
    return {"prompt": e["prompt"], "completion": e["completion"][:k] + wrong + e["completion"][k + 1:]}

rows = data.sft_arrays([with_slip(e, k) for e, k in zip(validation, slip_at)], tok, data.LONG_SEQ_LEN)
after_slip = (rows["loss_mask"] > 0).argmax(axis=1) + np.array(slip_at) + 1  # where digit k + 1 is predicted
bits = [e["prompt"].removeprefix("cnt ").removesuffix("=") for e in validation]
right = np.array([tok.encode(e["completion"][k + 1])[0] for e, k in zip(validation, slip_at)])
carried = np.array([tok.encode(str((int(e["completion"][k]) + 1 + int(b[k + 1])) % 10))[0]
                    for e, k, b in zip(validation, slip_at, bits)])  # the slipped digit plus the next bit
for name, (g, p) in count_models.items():
    predicted = np.asarray(model.apply(g, p, rows["inputs"], rows["attention_mask"])).argmax(-1)[
        np.arange(len(validation)), after_slip]
    mine = {"right": float(np.mean(predicted == right)), "carried": float(np.mean(predicted == carried))}
    assert mine == count_family.after_a_slip(g, p, validation)  # the same measure in tunix_nb
    print(f"{name:14} right after a slip, the next digit is right {mine['right']:.1%}, "
          f"the slip carried on {mine['carried']:.1%}")

# %% [markdown]
# Right after a miscount the student gives the right next digit 47.1% of the time and
# carries the slip on 47.5% of the time: it has learnt both rules, and they agree on every
# right prefix it was trained on. The teacher gives the right digit 99.9% of the time.
# Offline distillation shows the student right prefixes only; on-policy training shows it
# its own miscounts, with the teacher's correction at each.
#
# **The design, chosen on the validation split**: the same experiment with
# `--set family=count`, two seeds each (`results/lesson11_count_pilots/`, each record with
# the command that made it, e.g.
# `python -m tunix_nb.experiments lesson11_gkd --seeds 2 --set family=count --set eval_split=validation --set steps=40 --out results/lesson11_count_pilots/steps_40.json`).
# The longest third is here the 14-digit answers (464 of the 1000 test prompts; short bit
# strings run out, data/README.md):

# %%
print(f"{'design (count family, validation split, 2 seeds)':48}{'offline, on-policy':>19}{'on-policy - offline':>44}"
      "  own-prefix share  slip carried on")
for config, found in pilot_summaries("lesson11_count_pilots"):
    shares = found["own_prefix_share_longest_third"]
    arms, slips = found["edit_similarity_longest_third"], found["after_a_slip"]
    design = f"T {config['temperature']}, {config['steps']} steps at learning rate {config['learning_rate']:g}"
    design += f", β {config['beta']}" * (config["beta"] != 0.5) + f", lmbda {config['lmbda']}" * (config["lmbda"] != 1)
    print(f"{design:48}{arms['offline']['mean']:>11.4f}, {arms['on_policy']['mean']:.4f}"
          f"{similarity(found['on_policy_over_offline_longest_third']):>44}  "
          f"{shares['offline']['mean']:.0%} -> {shares['on_policy']['mean']:.0%}    "
          f"{slips['offline']['carried']['mean']:.1%} -> {slips['on_policy']['carried']['mean']:.1%}")

# %% [markdown]
# At the long family's 200 steps both arms end near the ceiling (0.9965 and 0.9964): distilled
# on right prefixes, the offline student also learns to count well enough that few slips are
# left to compound. Sampling hotter shows the student more of its own slips and lowers the
# share further, but raises its errors after the right prefix, as on the long family (at
# T = 2, by far). And more steps do not teach more correction: after 200 steps the on-policy
# student still carries 47.7% of miscounts on (offline 51.2%). A student that seldom slips
# seldom samples a miscount for the teacher to correct. 40 steps gave the largest gain, +0.0023, its interval above zero on the two
# validation seeds, so the stored run trains 40 steps, fixed before it scored the test
# prompts. (The other six rows, forward KL (β 0), learning rates 3e-3 and 1e-2, and the
# mixture (lmbda 0.5), were run after the test run, to find out why it gained nothing; none
# has a larger gain, so none would have changed the choice.)
#
# ```bash
# python -m tunix_nb.experiments lesson11_gkd --seeds 5 --set family=count --set steps=40 --out results/lesson11_gkd_count.json
# ```

# %%
count_record = json.loads((RESULTS / "lesson11_gkd_count.json").read_text())
count_summary = count_record["summary"]  # recomputed from its runs by tests/test_experiment_results.py
show_headline(count_summary)
for probe, what in (("after_a_slip", "a slip planted"), ("after_own_slip", "its own first slip")):
    for arm, slip in count_summary[probe].items():
        print(f"{arm:10} right after {what + ' (test split):':32} right digit {slip['right']['mean']:.1%}, "
              f"the slip carried on {slip['carried']['mean']:.1%}")

# %% [markdown]
# **What five seeds show on running counts.** The gain chosen on validation does not hold on
# the test prompts. On the longest third (the 14-digit answers) on-policy minus offline is
# **+0.0006 (95% interval -0.0012 to +0.0022)**, positive on three seeds of five, and exact
# match, the control, moves by -0.4 points (95% interval -1.1 to +3.4). The share of errors
# the student's own prefix causes falls from 49% to 42%, not to half.
#
# What on-policy training is for does happen, on every seed
# (`tests/test_experiment_results.py` asserts it seed by seed): right after a miscount
# planted one too high the on-policy student gives the right digit more often (52.6% →
# 56.6%) and carries the slip on less often (43.3% → 39.8%). After its own first slip,
# free-running, it hardly changes (right digit 49.1% → 50.3%, carried on 43.8% → 42.8%), and
# not on every seed. But it moves only a little, and more steps (200, in the pilots) teach
# the offline student to count well enough that few slips are left to compound. So on this
# design too the mechanism is there, and measured, but not a gain. The pilots show why
# correcting more does not pay.

# %% [markdown]
# ### What a correction costs
#
# Set the two against each other, pilot by pilot: how much less often the on-policy student
# carries a slip on than its offline twin, and how much more often it errs after the right
# prefix (teacher-forced, the longest third). Spearman's rank correlation asks whether they
# rise together without assuming a straight line (`stats.rank_correlation`, checked here by hand):

# %%
pilots = {path.stem: json.loads(path.read_text())["summary"]
          for path in sorted((RESULTS / "lesson11_count_pilots").glob("*.json"))}
corrected, cost = {}, {}
for name, found in pilots.items():
    slips, forced = found["after_a_slip"], found["teacher_forced_error_longest_third"]
    corrected[name] = slips["offline"]["carried"]["mean"] - slips["on_policy"]["carried"]["mean"]  # fewer slips carried on
    cost[name] = forced["on_policy"] - forced["offline"]  # more errors after the right prefix
    assert count_family.correction_and_cost(found) == {"corrected": corrected[name], "cost": cost[name]}
print(f"{'pilot (validation, 2 seeds), on-policy - offline':50}{'slips carried on':>18}{'error after the right prefix':>32}")
for name in sorted(pilots, key=corrected.get):
    print(f"{name:50}{-100 * corrected[name]:>+11.1f} points{100 * cost[name]:>+25.2f} points")
def ranks(figures):  # how many are smaller, plus half the others equal to it (ties share their mean rank)
    v = np.round(np.array(list(figures.values())), 12)  # equal up to float rounding: a tie
    return (v[:, None] > v).sum(1) + ((v[:, None] == v).sum(1) - 1) / 2

spearman = np.corrcoef(ranks(corrected), ranks(cost))[0, 1]
assert np.isclose(spearman, stats.rank_correlation(list(corrected.values()), list(cost.values())))
print(f"rank correlation of the two over the {len(pilots)} pilots: {spearman:.2f}")


# %% [markdown]
# **Correcting a slip has a price.** Across the twelve pilots the two rise together (rank
# correlation 0.85). Where the on-policy student carries only a few fewer slips on (40 steps,
# 2.0 points) it pays nothing after the right prefix. Where it carries the most fewer on
# (learning rate 1e-2, 19.4 points; T = 2, 16.8 points) it errs 2.17 and 2.39 points more
# often after the right prefix, and its edit similarity falls below offline's. One row
# stands apart, learning rate 3e-3 (8.0 points fewer for +0.03), yet its gain on validation
# is no larger than that of 40 steps.
#
# Is the price that of sampling, or of the corrections themselves? A diagnostic arm tells
# them apart: offline distillation whose answer inputs are swapped at a fixed rate, as the
# teacher's were (`--set offline_slip_rate=0.1`, `long_family.with_wrong_prefixes`). The
# teacher scores every position, so after each swap it teaches the correction, and nothing
# is sampled. Its control keeps the same swapped rows but leaves every position from a
# row's first swap on out of the loss (`--set offline_slip_taught=false`): the same right
# prefixes to learn from, and no correction taught (`results/lesson11_count_diagnostics/`;
# the same seeds and 40 steps as the chosen pilot, whose on-policy arm each record repeats
# exactly):

# %%
def arm_line(name, found, arm):
    return (f"{name:48}{found['after_a_slip'][arm]['carried']['mean']:>16.1%}"
            f"{found['teacher_forced_error_longest_third'][arm]:>16.2%}"
            f"{found['edit_similarity_longest_third'][arm]['mean']:>18.4f}")

chosen = json.loads((RESULTS / "lesson11_count_pilots" / "steps_40.json").read_text())
without_seconds = lambda runs: [{k: v for k, v in run.items() if k != "seconds"} for run in runs]  # noqa: E731
print(f"{'arm (validation, 2 seeds, 40 steps)':48}{'slip carried on':>16}{'error after':>16}{'edit similarity':>18}")
print(f"{'':48}{'':>16}{'the right prefix':>16}{'(longest third)':>18}")
print(arm_line("offline, the dataset's answers", chosen["summary"], "offline"))
for path in sorted((RESULTS / "lesson11_count_diagnostics").glob("*.json")):
    diagnostic = json.loads(path.read_text())
    assert without_seconds(diagnostic["runs"]["long"]["on_policy"]) == without_seconds(chosen["runs"]["long"]["on_policy"])
    taught = diagnostic["config"]["offline_slip_taught"]  # False: nothing after a row's first swap in the loss
    print(arm_line(f"offline, {diagnostic['config']['offline_slip_rate']} of inputs swapped"
                   + ("" if taught else ", untaught"), diagnostic["summary"], "offline"))
print(arm_line("on-policy", chosen["summary"], "on_policy"))
longer = json.loads((RESULTS / "lesson11_count_pilots" / "steps_200.json").read_text())
print(arm_line("offline, the dataset's answers, 200 steps", longer["summary"], "offline"))


# %% [markdown]
# Taught corrections without sampling, the offline student carries fewer slips on (47.0% →
# 37.7% at a tenth swapped, 26.4% at 0.3), and it too errs more after the right prefix (0.99%
# → 1.46% and 2.22%), so its edit similarity falls (0.9823 → 0.9771 and 0.9652). The untaught
# controls correct nothing (46.0% and 48.5% carried on) and still err more after the right
# prefix (1.19% and 2.16%): at a tenth swapped, about half of the price; at 0.3, nearly all.
#
# So most of the price is not the correction itself but what it displaces. With the
# teacher's forward passes fixed, every position after a wrong prefix is one position fewer
# after a right prefix, and 40 steps in, the student is still learning to count: after the
# right prefix it errs less with every step of plain distillation (0.99% at 40 steps, 0.20%
# at 200). The rest of the price, at a tenth swapped, is the
# correction's own: after a slip the right digit is the count of 1s in the input so far, a
# harder rule than adding the next bit to the last digit, and the two-layer student gives it
# only about half the time (above). DAgger's bound assumes a learner whose error after the
# right prefix is already at its floor, so that showing it its own mistakes costs nothing
# else. This student is far from its floor, and on this task what on-policy training
# corrects is paid for after the right prefix: the two come out about even. The third
# design takes a student nearer its floor.

# %% [markdown]
# ## A third design: a one-layer student
#
# DAgger's bound compares learners that are equally good after the right prefix; on-policy
# training then only has to teach what comes after a wrong one. So the third design keeps
# the task and the teacher and changes the student: `data/count_small_student`, the `tiny`
# preset (one layer), trained on the same examples to the end of its schedule rather than
# stopped early (`count_family.SMALL_STUDENT`; data/README.md). It slips more because one
# layer counts worse, and it learns more slowly after the right prefix, so a wrong prefix in
# its batch displaces less. Its datasheet figure, what it does after a slip, and sixteen
# pilots on the validation split (`--set student=small_student`,
# `results/lesson11_small_student_pilots/`):

# %%
small_student = count_family.load("small_student")
slip = count_family.after_a_slip(*small_student, validation)
pilots = {path.stem: json.loads(path.read_text()) for path in
          sorted((RESULTS / "lesson11_small_student_pilots").glob("*.json"))}
print(f"small student: {model.count_params(small_student[1]):,} params (the count student "
      f"{model.count_params(count_models['count student'][1]):,}), validation exact match "
      f"{next(iter(pilots.values()))['setup']['validation_exact_match']['student']:.1%}")
print(f"right after a slip, the next digit is right {slip['right']:.1%}, the slip carried on {slip['carried']:.1%}")
print(f"{'pilot (validation, 2 seeds)':38}{'offline, on-policy':>19}{'on-policy - offline':>44}  own-prefix share"
      "  error after the right prefix  own slips carried on")
for pilot in sorted(pilots.values(), key=lambda p: (p["config"]["steps"], p["config"]["temperature"], -p["config"]["beta"],
                                          p["config"]["learning_rate"])):
    found = pilot["summary"]
    arms, shares = found["edit_similarity_longest_third"], found["own_prefix_share_longest_third"]
    config = pilot["config"]
    divergence = {0: "forward KL", 1: "reverse KL"}.get(config["beta"], f"JSD({config['beta']:g})")
    label = f"{config['steps']:>4} steps, T = {config['temperature']:g}, {divergence}"
    label += f", lr {config['learning_rate']:g}" if config["learning_rate"] != 1e-3 else ""
    print(f"{label:43}{arms['offline']['mean']:>12.4f}, {arms['on_policy']['mean']:.4f}"
          f"{similarity(found['on_policy_over_offline_longest_third']):>44}  "
          f"{shares['offline']['mean']:.0%} -> {shares['on_policy']['mean']:.0%}"
          f"{found['teacher_forced_error_longest_third']['offline']:>16.2%} -> "
          f"{found['teacher_forced_error_longest_third']['on_policy']:.2%}"
          f"{found['after_own_slip']['offline']['carried']['mean']:>15.1%} -> "
          f"{found['after_own_slip']['on_policy']['carried']['mean']:.1%}")


# %% [markdown]
# With 18,624 parameters (the count student has 123,392), the small student gets 68.5% of
# the validation answers right and carries 58.5% of planted miscounts on. It is nearer its
# floor than the count student, not at it: from 40 to 200 offline steps its error after the
# right prefix falls by about a quarter (2.58% → 1.96%), where the count student's falls by
# four fifths (0.99% → 0.20%, above), and it still falls at 2000 steps (1.15%).
#
# Two pilots came before the test run, 40 and 200 steps. Both put on-policy above offline
# with intervals above zero on the two validation seeds, and on-policy errs no more after
# the right prefix than offline does (2.46% and 1.83%). The 40-step pilot has the larger
# gain, +0.0059, so the stored run trains 40 steps, fixed before it scored the test prompts:
#
# ```bash
# python -m tunix_nb.experiments lesson11_gkd --seeds 5 --set family=count --set student=small_student --set steps=40 --out results/lesson11_gkd_small_student.json
# ```
#
# The other fourteen came after it, to ask whether more steps, hotter or colder sampling, a
# larger learning rate, or another divergence halve the share of errors the student's own prefix
# causes, as DAgger's argument would have on-policy training do. None has a larger
# gain, so none would have changed the choice (a test asserts it). Sampled at T = 1, the gain is positive at every number of steps; with two seeds a pilot's
# interval is wide, and it stays above zero only at 1000 and 2000 steps. With more steps on-policy
# training corrects more: at 1000 steps it carries 16.0% of its own slips on (the last
# column, after its own first wrong digit, `count_family.after_own_slip` below), where
# offline carries 33.6% on, and the share falls from 46% to 30%, its lowest at T = 1, still
# not half. Sampling hotter lowers it most, to 26% at 1000 steps, but there the on-policy
# student errs more after the right prefix (1.39% → 1.54%), and the gain is gone: +0.0009 (95% interval -0.0001 to +0.0018).
#
# Two pilots change the divergence, for both arms, to the forward KL (β = 0). The reason to
# try it: where the student is sure of a wrong digit and the teacher of the right one, the
# generalized JSD saturates (it is bounded by log 2) and its gradient vanishes, while the
# forward KL's pull on the right digit's logit is its full probability gap. A slip carried
# on is such a place. It does not help. At 40 steps the gain is +0.0046 (95% interval -0.0102 to +0.0193), below the JSD's +0.0059; at 1000 steps the on-policy student carries
# 15.3% of its own slips on (JSD(0.5): 16.0%), the share falls from 45% to 32%, and the gain
# is +0.0022 (95% interval -0.0145 to +0.0189).
#
# Sampling colder, at T = 0.5, keeps the on-policy batch near the greedy answers the student
# is scored on, so that the slips it is taught to come back from are the ones it makes at
# inference. That does not help either: at 1000 steps it carries 15.6% of its own slips on,
# the share falls from 46% to 29%, and the gain is +0.0033 (95% interval +0.0005 to +0.0062). Whatever the steps, the temperature or the divergence, the on-policy student
# still carries about 13% to 19% of its own slips on.
#
# The last five close the search. The reverse KL (β = 1), the mode-seeking divergence MiniLLM
# trains with on-policy, does no better than the JSD: at 1000 steps the share falls from 44%
# to 33%, with a gain of +0.0027 (95% interval -0.0082 to +0.0137). Training longer or faster
# lowers the offline arm's share too, since the offline student also learns to carry fewer of
# its own slips on: at learning rate 0.003 (1000 steps) it carries 22.3% on and its share is
# 39% (on-policy 31%); at 2000 steps and T = 1.5 the share falls from 41% to 31%. From 1000
# steps on, the on-policy share stays between 26% and 33% whatever the setting, so halving it
# needs an offline share of 52% or more, which no pilot has from 1000 steps on (46% at most).
# Sampling at T = 2 is the one pilot that changes what the student does after a slip it did
# not make, below.

# %% [markdown]
# ### What one layer can learn
#
# The planted probe, pilot by pilot, as for the count student above: how much less often the
# on-policy student carries a planted miscount on than its offline twin, and how much more
# often it errs after the right prefix (`count_family.correction_and_cost`):

# %%
trade = {name: count_family.correction_and_cost(pilot["summary"]) for name, pilot in pilots.items()}
print(f"{'pilot (validation, 2 seeds), on-policy - offline':50}{'planted slips carried on':>26}"
      f"{'error after the right prefix':>32}")
for name in sorted(trade, key=lambda n: trade[n]["corrected"]):
    print(f"{name:50}{-100 * trade[name]['corrected']:>+19.1f} points{100 * trade[name]['cost']:>+25.2f} points")
print(f"rank correlation of the two over the {len(trade)} pilots: "
      f"{stats.rank_correlation([t['corrected'] for t in trade.values()], [t['cost'] for t in trade.values()]):.2f}")
hot = next(p["summary"] for p in pilots.values() if p["config"]["temperature"] == 2)
for arm, planted in hot["after_a_slip"].items():
    print(f"T = 2, {arm:10} right after a planted slip: right digit {planted['right']['mean']:.1%}, "
          f"the slip carried on {planted['carried']['mean']:.1%}")

# %% [markdown]
# **One layer cannot do both.** In fifteen of the sixteen pilots the on-policy student carries
# a planted miscount on nearly as often as its offline twin (at most 2.6 points less often):
# what falls is how often it carries on the slips it makes itself (the table above), not a
# rule that recounts from the input after any wrong digit. The two columns rise together less
# tightly than for the count student (rank correlation 0.49 against 0.85), since the planted
# probe barely moves. Only sampling at T = 2, which fills the batch with the student's slips,
# teaches it to recount: right after a planted slip it gives the right digit 60.6% of the time
# instead of 39.2%, and carries the slip on 34.9% of the time instead of 57.9%. It pays after
# the right prefix, where its error rises from 1.39% to 2.27%, and its edit similarity falls
# below offline's by 0.0098. With 18,624 parameters, counting along the right prefix and
# recounting after a wrong one compete for the same layer: the one-layer design keeps its gain
# where it does not learn the second rule, and there it cannot halve the share its own prefix
# causes.

# %% [markdown]
# The probe plants a slip where it chooses. What the student meets when it runs on its own
# are the slips it makes itself. Built here on the shipped small student's greedy
# validation answers: each answer's first wrong digit k, and whether its digit k + 1 is the
# right one or the slip carried on (`count_family.after_own_slip` measures the same for each
# arm of the stored runs):

# %%
# The small student's own slips, built here: its greedy answers, each one's first wrong digit k
# (within the right answer's length), and what its digit k + 1 is.
answers = evaluate.generate_answers(*small_student, [e["prompt"] for e in validation], **long_family.LENGTHS)
T = max(len(e["completion"]) for e in validation)
gold_NxT = np.array([list(e["completion"].ljust(T)) for e in validation])
own_NxT = np.array([list(a[:T].ljust(T)) for a in answers])
bits_NxT = np.array([list(e["prompt"][len("cnt "):-1].ljust(T, "0")) for e in validation]).astype(int)
length_N = np.array([len(e["completion"]) for e in validation])
wrong_NxT = (own_NxT != gold_NxT) & (np.arange(T) < length_N[:, None])
k_N = wrong_NxT.argmax(axis=1)  # the first wrong digit (0 where none is wrong: masked out next)
slipped_N = wrong_NxT.any(axis=1) & (k_N < length_N - 1)  # a slip with a digit after it
n, k = np.nonzero(slipped_N)[0], k_N[slipped_N]
following = own_NxT[n, k + 1]
own_digit = np.char.isdigit(own_NxT[n, k])  # a slip to a non-digit is never carried on
own_k = np.where(own_digit, own_NxT[n, k], "0").astype(int)
carried = own_digit & (following == ((own_k + bits_NxT[n, k + 1]) % 10).astype(str))
mine = {"slips": len(n), "right": float(np.mean(following == gold_NxT[n, k + 1])), "carried": float(np.mean(carried))}
assert mine == count_family.after_own_slip(answers, validation)  # the same measure in tunix_nb
print(f"small student, validation: {mine['slips']} answers slip before their last digit; right after its own "
      f"first slip the next digit is right {mine['right']:.1%}, the slip carried on {mine['carried']:.1%}")
print(f"(after a slip planted one too high: right {slip['right']:.1%}, carried on {slip['carried']:.1%})")
later = (wrong_NxT[n] & (np.arange(T) > k[:, None])).sum(axis=1)  # wrong digits after the first slip
print(f"wrong digits after the first slip: {later[carried].mean():.2f} an answer where it is carried on, "
      f"{later[~carried].mean():.2f} where it is not; the slips carried on make {later[carried].sum() / later.sum():.0%} "
      "of them")

# The same digit k + 1 after the right prefix: does the student's own wrong digit k cause the slip carried on?
rows = data.sft_arrays(validation, tok, data.LONG_SEQ_LEN)
forced_NxL = np.asarray(model.apply(*small_student, rows["inputs"], rows["attention_mask"])).argmax(-1)
first_N = (rows["loss_mask"] > 0).argmax(axis=1)  # where the answer's first digit is predicted
forced_next = np.array([tok.decode([int(t)]) for t in forced_NxL[n, first_N[n] + k + 1]])
print(f"after the right prefix it gets digit k + 1 right in {np.sum(forced_next[carried] == gold_NxT[n, k + 1][carried])}"
      f" of the {carried.sum()} slips it carries on")

# %%
small_record = json.loads((RESULTS / "lesson11_gkd_small_student.json").read_text())
small_summary = small_record["summary"]  # recomputed from its runs by tests/test_experiment_results.py
show_headline(small_summary)

def show_probes(summary):
    for probe, what in (("after_a_slip", "a slip planted"), ("after_own_slip", "its own first slip")):
        for arm, slip in summary[probe].items():
            print(f"{arm:10} right after {what + ' (test split):':32} right digit {slip['right']['mean']:.1%}, "
                  f"the slip carried on {slip['carried']['mean']:.1%}")


show_probes(small_summary)


# %% [markdown]
# **What five seeds show with a one-layer student.** On the longest third (the 14-digit
# answers) on-policy minus offline is **+0.0037 (95% interval +0.0026 to +0.0095)**, positive on all five seeds. Over all answers the gain is
# +0.0013 (95% interval +0.0001 to +0.0024), and exact match, the control, moves by -0.7 points (95% interval -1.3 to -0.2), an interval below zero: the gain is in the long answers,
# where errors have room to compound, and in how much of an answer is right, while slightly
# fewer answers are right.
#
# Where it comes from: the free-running token error falls from 5.12% to 4.52% while the
# teacher-forced one barely moves (2.44% to 2.41%), so what on-policy training removed is
# error after the student's own prefix. The planted probe hardly moves (59.1% → 58.3%
# carried on); the student's own slips do. Right after its own first slip the on-policy
# student gives the right digit more often (74.8% → 79.4%) and carries the slip on less
# often (20.8% → 16.9%), on every seed (`tests/test_experiment_results.py` asserts it seed
# by seed).
#
# The share of errors its own prefix causes falls from 52% to 47%, not to half. The validation cell above shows what those errors are made of. A
# slip carried on is the student's own prefix at work: after the right prefix it gets that
# next digit right in 74 of the 75 slips it carries on. A slip carried on leaves 2.55 later
# digits wrong on average, one the student comes back from 0.26, so the slips carried on,
# about a quarter of them, make 78% of the wrong digits after a first slip. On-policy
# training carries about a fifth fewer on (20.8% → 16.9%), and the errors its own prefix
# causes (free-running minus teacher-forced) fall by about as much. The share falls by less,
# since those errors are part of its denominator too: with the errors after the right prefix
# unchanged, halving a share of 52% takes removing about two thirds of the errors the
# student's own prefix causes. Even the 1000-step pilot, which halves the slips carried on,
# takes the share only to 30% (above); the next section
# shows what the rest is made of.
#
# Across the three designs the lesson is DAgger's assumption, seen from both sides. With a
# student still learning fast after the right prefix (the first two), every wrong prefix in
# a batch displaces a right one it needed, and on-policy training pays for what it corrects.
# With a student nearer its floor, less is displaced, and on-policy distillation beats
# offline distillation on the long answers, on every seed.

# %% [markdown]
# ### What the share counts
#
# The share charges to the student's own prefix every free-running error that the right
# prefix does not make. Most of them are slips carried on. One kind is not: an answer that
# stops early. After its eos the answer has no more tokens, so each missing position is a
# free-running error, while after the right prefix, which has no eos there, the student
# predicts that digit. The eos itself is one wrong token, counted where it is made. Split
# here by where each error lies, within the student's own answer (its digits and its eos)
# or after an early eos, from the greedy answers and the teacher-forced pass above, on the
# longest third of the validation answers, and checked against
# `evaluate.errors_after_own_end`:

# %%
# Where the small student's errors on the longest third lie, built here from the greedy answers and
# the teacher-forced pass above: within its own answer (its digits and its eos), or after an early eos.
long_N = gkd_long_answers.longest_third(validation)
counts = {part: {"free_running": 0, "teacher_forced": 0} for part in ("within", "after_end")}
early_stops = stops_after_the_right_prefix_too = 0
for i in np.flatnonzero(long_N):
    own, gold = answers[i] + "$", validation[i]["completion"] + "$"  # "$" stands for the eos
    for k, token in enumerate(gold):
        part = "within" if k < len(own) else "after_end"  # after its eos the answer has no token k
        counts[part]["free_running"] += part == "after_end" or own[k] != token
        counts[part]["teacher_forced"] += forced_NxL[i, first_N[i] + k] != rows["targets"][i, first_N[i] + k]
    if len(own) < len(gold):  # an early eos: does it stop there after the right prefix too?
        early_stops += 1
        stops_after_the_right_prefix_too += forced_NxL[i, first_N[i] + len(answers[i])] == tok.eos_id
longest = [e for e, x in zip(validation, long_N) if x]
right = evaluate.right_tokens_by_row(*small_student, longest, seq_len=data.LONG_SEQ_LEN, **long_family.LENGTHS)
assert counts == evaluate.errors_after_own_end(right)  # the same split in tunix_nb
caused = {part: c["free_running"] - c["teacher_forced"] for part, c in counts.items()}
free = sum(c["free_running"] for c in counts.values())
print(f"longest third: {len(longest)} answers; {early_stops} stop early, {stops_after_the_right_prefix_too} of them "
      "at the same digit after the right prefix too")
for part, c in counts.items():
    print(f"{part:10} free-running errors {c['free_running']:4}, teacher-forced {c['teacher_forced']:4}, "
          f"caused by its own prefix {caused[part]:4}")
print(f"share its own prefix causes: {sum(caused.values()) / free:.0%} of all its errors; "
      f"{caused['within'] / counts['within']['free_running']:.0%} within its answers; the missing tails are "
      f"{caused['after_end'] / sum(caused.values()):.0%} of what its own prefix causes")

# %% [markdown]
# Of the 36 answers that stop early, 28 stop at the same digit after the right prefix too:
# most of those early stops are errors it makes whatever the prefix, and the tail each leaves
# is what the share then charges to the prefix. On-policy training teaches the student what to
# do after a wrong token of its own; after an eos there is nothing left to teach, only the eos
# itself, which offline training teaches as well. For the shipped
# student those tails are 17% of the errors its own prefix causes, and its share within its
# answers is 48%, against 52% over all of it.
#
# Each stored run keeps the same split (`errors_by_own_end`). Besides the 40-step test run,
# one more five-seed run on the test prompts, at 1000 steps: among the validation pilots at
# the default temperature, divergence and learning rate, the one whose on-policy arm left
# the lowest share (30%; 32% at 2000 steps), fixed before it scored the test prompts (a
# test checks the choice). Of the other 1000-step pilots, T = 0.5 left 29%, with the same
# gain, and T = 1.5 left 26%, where the gain is gone (the table above):
#
# ```bash
# python -m tunix_nb.experiments lesson11_gkd --seeds 5 --set family=count --set student=small_student --set steps=1000 --out results/lesson11_gkd_small_student_1000_steps.json
# ```

# %%
long_record = json.loads((RESULTS / "lesson11_gkd_small_student_1000_steps.json").read_text())
show_headline(long_record["summary"])
show_probes(long_record["summary"])
print(f"\n{'one-layer student, offline -> on-policy':40}{'share':>16}{'within answers':>16}{'missing tails':>16}"
      f"{'caused within (a seed)':>27}{'caused in tails (a seed)':>27}")
for name, rec in {"40 steps, test (5 seeds)": small_record, "1000 steps, validation (2 seeds)": pilots["steps_1000"],
                  "1000 steps, test (5 seeds)": long_record}.items():
    line = f"{name:40}"
    for key in ("own_prefix_share_longest_third", "own_prefix_share_within_answer_longest_third",
                "tail_part_of_own_prefix_errors_longest_third"):
        shares = rec["summary"][key]
        line += f"{shares['offline']['mean']:>9.0%} -> {shares['on_policy']['mean']:.0%}"
    for part in ("within", "after_end"):  # free-running minus teacher-forced errors, mean over seeds
        caused = {arm: np.mean([gkd_long_answers.own_prefix_part(r["errors_by_own_end"][part])
                                for r in rec["runs"]["long"][arm]]) for arm in ("offline", "on_policy")}
        line += f"{caused['offline']:>18.1f} -> {caused['on_policy']:.1f}"
    print(line)

# %% [markdown]
# **What the 1000-step run shows.** On the 14-digit answers on-policy minus offline is
# **+0.0046 (95% interval -0.0018 to +0.0058)**, positive on all five seeds, but one seed's gain
# is less than half the others' and the interval over five seeds reaches below zero (at 40
# steps +0.0037, its interval above zero; the two intervals overlap). Over all answers it is +0.0015 (95% interval +0.0001 to +0.0023), and exact match,
# the control, moves by -0.1 points (95% interval -1.6 to +0.5). Right after its own first
# slip the on-policy student carries it on 19.0% of the time, offline 34.6%; a planted slip
# it still carries on as often (58.2% against 58.6%). The share of errors its own prefix
# causes falls from 48% to 35%, not to half, again
# (`tests/test_experiment_results.py` marks it).
#
# Within its own answers, on-policy training does most of what it is for: the errors its own
# prefix causes there fall from 73.6 to 28.6 a seed, and the share within the answers from
# 43% to 24%. That is still not half on the test prompts (the two validation seeds gave 38%
# → 15%). The tails after an early eos it barely moves (26.6 → 25.2 a seed): they are 27%
# of what the offline student's own prefix causes, and 48% of what the on-policy student's
# causes. So the one-layer design's floor is not only a rule one layer cannot learn: about
# half of what is left are answers that end too early, mostly at a digit where the student
# stops after the right prefix too (as 28 of the shipped student's 36 early stops do,
# above), which leaves nothing after it for on-policy training to correct. A design that halves the share needs a student that does not stop early, as well as one that can
# learn to recount. The next section builds one.

# %% [markdown]
# ## A fourth design: counts of one length
#
# The one-layer student left about half of what its own prefix is charged with in answers
# that stop early, which on-policy training cannot reach. The fourth design removes them:
# running counts of exactly 14 bits (`data.generate_sft(n, seed, family="count14")`, splits
# in `tunix_nb.experiments.count14_family`), so where an answer ends is never in doubt and
# what is left to compound is a slip carried on. The student is one layer again
# (`data/count14_student`): the small student's recipe on these counts, stopped at step 200
# of its 2000 while it still miscounts now and then (data/README.md). The teacher is the
# count family's. Every answer has 14 digits, so the longest third is every answer.
#
# The student on 300 validation prompts, with the lesson's measures: its token error
# after the right prefix and after its own, the share its own prefix causes, how many
# answers stop early, and what it does right after its own first slip:

# %%
count14_student, count14_validation = count14_family.load("student"), count14_family.splits()["validation"][:300]
count14_answers = evaluate.generate_answers(*count14_student, [e["prompt"] for e in count14_validation],
                                            **long_family.LENGTHS)
count14_right = evaluate.right_tokens_by_row(*count14_student, count14_validation, seq_len=data.LONG_SEQ_LEN,
                                             **long_family.LENGTHS)
count14_errors = gkd_long_answers.error_figures(evaluate.error_rates(count14_right))
own_slip = count_family.after_own_slip(count14_answers, count14_validation)
print(f"count14 student: {model.count_params(count14_student[1]):,} params; exact match "
      f"{np.mean([a == e['completion'] for a, e in zip(count14_answers, count14_validation)]):.1%}; "
      f"{sum(len(a) < 14 for a in count14_answers)} answers stop early")
print(f"token error after the right prefix {count14_errors['teacher_forced_error']:.2%}, after its own "
      f"{count14_errors['free_running_error']:.2%}: its own prefix causes {count14_errors['own_prefix_share']:.0%} "
      "of its errors")
print(f"right after its own first slip ({own_slip['slips']} answers): right digit {own_slip['right']:.1%}, "
      f"the slip carried on {own_slip['carried']:.1%}")
example = next(e for e, a in zip(count14_validation, count14_answers)  # a slip after a right start
               if a != e["completion"] and a[:4] == e["completion"][:4])
own = count14_answers[count14_validation.index(example)]
print(f"\n{example['prompt']}\nright answer {example['completion']}\nits answer   {own}\n"
      f"             {''.join('^' if a != b else ' ' for a, b in zip(own, example['completion']))}")

# %% [markdown]
# One wrong digit, and every digit after it is off by the same amount: the student adds
# each bit to the digit before it, its own, and never counts again. Five pilots on the
# validation split, two seeds each, every setting the default but the number of steps
# (`--set family=count14 --set eval_split=validation --set steps=N`,
# `results/lesson11_count14_pilots/`):

# %%
count14_pilots = {int(path.stem.removeprefix("steps_")): json.loads(path.read_text()) for path in
                  (RESULTS / "lesson11_count14_pilots").glob("*.json")}
print(f"{'steps':>5}{'offline, on-policy':>20}{'on-policy - offline':>44}{'own-prefix share':>17}"
      f"{'free-running error':>22}{'after the right prefix':>24}{'right after own slip':>22}")
def right_after_own_slip(pilot, arm):  # "no slips" where the arm made none to be right after
    slips = sum(run["after_own_slip"]["slips"] for run in pilot["runs"]["long"][arm])
    return f"{pilot['summary']['after_own_slip'][arm]['right']['mean']:.1%}" if slips else "no slips"


for steps, pilot in sorted(count14_pilots.items()):
    found = pilot["summary"]
    arms, shares = found["edit_similarity_longest_third"], found["own_prefix_share_longest_third"]
    free, forced = found["free_running_error_longest_third"], found["teacher_forced_error_longest_third"]
    print(f"{steps:>5}{arms['offline']['mean']:>12.4f}, {arms['on_policy']['mean']:.4f}"
          f"{similarity(found['on_policy_over_offline_longest_third']):>44}"
          f"{shares['offline']['mean']:>9.0%} -> {shares['on_policy']['mean']:.0%}"
          f"{free['offline']['mean']:>12.2%} -> {free['on_policy']['mean']:.2%}"
          f"{forced['offline']:>14.2%} -> {forced['on_policy']:.2%}"
          f"{right_after_own_slip(pilot, 'offline'):>13} -> {right_after_own_slip(pilot, 'on_policy')}")

# %% [markdown]
# The two arms learn different things, and at different times. On-policy training changes
# the student's answers from 80 steps on: it gives the right digit after most of its own
# slips (78.9%), by 120 steps after nearly all (98.4%). It has learnt to count again after a
# wrong digit of its own, so its errors stay where it makes them. Offline distillation, taught
# only after right prefixes, leaves the answers as they were up to 120 steps (share 93%, near
# the shipped student's 92% above) and the student carries every slip of its own on (0.0% right).
# Then its answers change in a jump: by 200 steps it no longer slips at all (free-running
# error 0.01%), nothing is left to compound, and the on-policy student, which still slips
# after the right prefix (3.30%), loses: -0.0354 (95% interval -0.0363 to -0.0345). The gain
# is a window, from about 80 to 160 steps. Offline training lowers ε; on-policy training
# lowers what each slip costs.
#
# By the rule of the earlier designs (the pilot with the largest gain), the test run takes
# 120 steps, fixed before it scored the test prompts (a test checks that its settings are
# the best pilot's):
#
# ```bash
# python -m tunix_nb.experiments lesson11_gkd --seeds 5 --set family=count14 --set steps=120 --out results/lesson11_gkd_count14.json
# ```

# %%
count14_record = json.loads((RESULTS / "lesson11_gkd_count14.json").read_text())
count14_summary = count14_record["summary"]  # recomputed from its runs by tests/test_experiment_results.py
show_headline(count14_summary)
show_probes(count14_summary)
for arm in gkd_long_answers.ARMS:
    seeds = count14_record["runs"]["long"][arm]
    caused = {part: np.mean([gkd_long_answers.own_prefix_part(r["errors_by_own_end"][part]) for r in seeds])
              for part in ("within", "after_end")}
    shares = count14_summary["own_prefix_share_longest_third"][arm]["per_seed"]
    print(f"{arm:10} errors its own prefix causes, a seed: {caused['within']:.1f} within its answers, "
          f"{caused['after_end']:.1f} in missing tails; share by seed {', '.join(f'{s:.1%}' for s in shares)}")

# %% [markdown]
# **What five seeds show on counts of one length.** On-policy minus offline in edit
# similarity is **+0.2293 (95% interval +0.2148 to +0.2320)**, positive on all five seeds
# (every answer is in the longest third), at 120 steps. The share of errors
# caused by the student's own prefix falls from 93% to 4%, on every seed: far below half. What on-policy training removed is the slips carried on: free-running
# token error 44.07% → 3.45%, while after the right prefix the error barely moves (3.15% →
# 3.30%). Right after its own first slip the on-policy student gives the right digit 98.2%
# of the time, the offline one never. Almost every answer has its 14 digits, so these errors
# lie within the answers: in missing tails 0.0 a seed offline and 3.0 on-policy, against
# 6138.0 and 19.6 within them.
#
# Two things the run does not show. Exact match, the control, moves by -1.9 points (95% interval -3.3 to -1.1): an answer with one slip is wrong whether the slip is carried on or
# not, and the on-policy student slips a little more often. And a slip planted one too high
# the on-policy student still carries on 95.9% of the time, as the offline one does: it
# learnt to recover from the slips it makes, the states its own policy visits, as DAgger's
# argument predicts, not to count from the input whatever the prefix.
#
# And the gain is measured in a window. At 120 steps, the step chosen on validation among
# runs of fixed length, offline distillation has not yet changed the student (share 93%,
# near the shipped student's 92%); by 200 steps it removes the slips themselves and wins
# (the pilots above). [Lesson 11](../notebooks/11_on_policy_distillation.ipynb) therefore
# gives each arm its own budget: one trajectory each, scored on validation along the way,
# and each arm's test score taken at its own best checkpoint. There, offline distillation
# is as good or a hair better, and on-policy distillation is faster to a given score, not
# better. A student that cannot reach zero error after the right prefix keeps paying for
# every slip it carries on, and that cost is what on-policy distillation removes; this
# student, given enough offline steps, stops slipping.

# %% [markdown]
# ## What the four designs show
#
# - On long answers (6 to 14 symbols), on-policy distillation lowers the share of errors
#   the student's own prefix causes, on every seed (on reversals, where slips compound,
#   from 35% to 6%), but raises its errors after the right prefix more: edit similarity
#   on the longest third -0.0002 (95% interval -0.0083 to +0.0051), exact match -4.3
#   points (95% interval -5.2 to -3.3). DAgger's argument is a bound, and it pays where
#   offline students drift over long generations.
# - On running counts, built so that a miscount is carried into every later digit, with a
#   teacher trained to correct it: on-policy training corrects more of the student's
#   miscounts on every seed, but its edit similarity gain on the 14-digit answers is
#   +0.0006 (95% interval -0.0012 to +0.0022). Across twelve validation pilots, the more
#   slips on-policy training corrects, the more errors it adds after the right prefix (rank
#   correlation 0.85); an offline arm taught corrections without sampling pays it too, and
#   its untaught control pays most of it: the wrong prefixes displace right ones the
#   student is still learning from.
# - With a one-layer student nearer its floor, on-policy distillation beats offline on the
#   14-digit answers: edit similarity +0.0037 (95% interval +0.0026 to +0.0095), positive
#   on all five seeds, by lowering the error after the student's own prefix (5.12% → 4.52%
#   of tokens). The share of errors that prefix causes falls from 52% to 47%, not to half;
#   sixteen validation pilots take it to 26% at best, where the gain is gone. About half
#   of what is left is the tail of answers that stop early, which on-policy training
#   barely moves.
# - On counts of exactly 14 bits, where no answer stops early, on-policy distillation at
#   a fixed 120 steps gains +0.2293 (95% interval +0.2148 to +0.2320) in edit similarity,
#   and the share of errors its own prefix causes falls from 93% to 4%. But the gain is a
#   window: at 120 steps offline distillation has not yet changed the student, and by 200
#   (on validation) it removes the slips themselves and wins. Lesson 11 compares the two
#   with each arm at its own best budget.
