"""The experiments' figures: every curve over seeds drawn as its mean, each seed faintly, and a band.

The band spans the seeds (lowest to highest), so a reader sees how much of a gap the
seeds alone could make. Functions draw on an `Axes` or make their own figure and
return it; none calls `plt.show()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

ARM_COLORS = {"labels": "C7", "teacher_labels": "C1", "distilled": "C0", "sft": "C7", "rft": "C1", "grpo": "C0",
              "offline": "C1", "on_policy": "C0"}


def plot_seed_band(ax, x: Sequence[float], values_SxX, *, label: str, color: str):
    """Mean over seeds as a line, each seed as a faint line, the seeds' range as a band."""
    values_SxX = np.asarray(values_SxX, dtype=np.float64)
    for row in values_SxX:
        ax.plot(x, row, color=color, alpha=0.25, linewidth=0.8)
    ax.fill_between(x, values_SxX.min(axis=0), values_SxX.max(axis=0), color=color, alpha=0.15)
    return ax.plot(x, values_SxX.mean(axis=0), color=color, marker="o", label=label)[0]


def scores_by_setting(record: dict, arm: str, key: str = "scores") -> np.ndarray:
    """[seeds, settings]: an arm's mean per-prompt score, per seed and setting."""
    return np.array([[np.mean(run[key]) for run in record["runs"][setting][arm]]
                     for setting in record["runs"]]).T


def plot_exact_match_by_labels(record: dict, *, title: str):
    """Lesson 02: test exact match against the number of labelled examples, one band per arm."""
    labels = [int(s.split("=")[1]) for s in record["runs"]]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm in next(iter(record["runs"].values())):
        plot_seed_band(ax, labels, 100 * scores_by_setting(record, arm), label=arm, color=ARM_COLORS.get(arm, "C3"))
    ax.set(xscale="log", xticks=labels, xticklabels=[str(n) for n in labels], xlabel="labelled examples",
           ylabel="test exact match (%)", title=title)
    ax.legend()
    return fig


def plot_pass_at_k(record: dict, *, title: str, setting: str = "long"):
    """Lesson 08: pass@k against k at temperature 1, one band per policy, a panel per sub-task."""
    runs = record["runs"][setting]
    tasks = np.array(next(iter(runs.values()))[0]["tasks"])
    names = sorted(set(tasks))
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(4 * (len(names) + 1), 3.4), sharey=True)
    for ax, task in zip(axes, ["all", *names]):
        rows = np.ones(len(tasks), bool) if task == "all" else tasks == task
        for arm, arm_runs in runs.items():
            ks = [int(k) for k in arm_runs[0]["pass_at_k"]]
            curve = [[100 * np.mean(np.asarray(r["pass_at_k"][str(k)])[rows]) for k in ks] for r in arm_runs]
            plot_seed_band(ax, ks, curve, label=arm, color=ARM_COLORS.get(arm, "C3"))
        ax.set(xscale="log", xticks=ks, xticklabels=[str(k) for k in ks], xlabel="k", title=task)
    axes[0].set_ylabel("test pass@k (%)")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_by_answer_length(record: dict, *, title: str, key: str = "scores", setting: str = "long"):
    """Lesson 11: the mean score by answer length, one band per arm."""
    runs = record["runs"][setting]
    lengths = np.array(next(iter(runs.values()))[0]["answer_length"])
    xs = sorted(set(lengths.tolist()))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm, arm_runs in runs.items():
        curve = [[np.mean(np.asarray(r[key])[lengths == n]) for n in xs] for r in arm_runs]
        plot_seed_band(ax, xs, curve, label=arm, color=ARM_COLORS.get(arm, "C3"))
    ax.set(xlabel="answer length (symbols)", ylabel=key.replace("_", " "), title=title)
    ax.legend()
    return fig


def plot_validation_curves(record: dict, *, title: str, key: str = "val_edit_similarity", setting: str = "long"):
    """Each arm's validation score along its one trajectory (the runs' "curve"), over the seeds;
    each seed's chosen checkpoint marked. Arms that do not train (no curve) are left out."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm, arm_runs in record["runs"][setting].items():
        if "curve" not in arm_runs[0]:
            continue
        steps = [point["step"] for point in arm_runs[0]["curve"]]
        values_SxX = [[point[key] for point in run["curve"]] for run in arm_runs]
        color = ARM_COLORS.get(arm, "C3")
        plot_seed_band(ax, steps, values_SxX, label=arm, color=color)
        chosen = [(run["chosen_step"], values[steps.index(run["chosen_step"])]) for run, values in zip(arm_runs, values_SxX)]
        ax.scatter(*zip(*chosen), color=color, marker="x", zorder=3)
    ax.set(xlabel="training step", ylabel=key.replace("_", " "), title=title)
    ax.legend()
    return fig
