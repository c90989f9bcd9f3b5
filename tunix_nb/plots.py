"""Plots: the small matplotlib figures the notebooks share.

Most functions draw on an `Axes` you pass in (so a notebook can lay out several
panels); the multi-panel training summaries at the end make their own figure and
return it. Each sets a title and axis labels, and returns what a caller may want to
check (the KL it shows, the artists it drew, the figure). Nothing here calls
`plt.show()`: the notebook decides when a figure is shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np


def softmax_at(logits_V, temperature: float) -> np.ndarray:
    """softmax(logits / T) over the last axis, in float64 NumPy (for drawing only)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    z = np.asarray(logits_V, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def kl_at(teacher_logits_V, student_logits_V, temperature: float) -> float:
    """KL(teacher_T || student_T) for one position, via `tunix_nb.losses`.

    `losses.kl_distillation_per_example` with alpha=1 returns T^2 * KL (the soft
    term of the loss); this divides the T^2 back out, so the value is the plain KL
    between the two distributions the plot shows.
    """
    import jax.numpy as jnp

    from tunix_nb import losses

    teacher_1xV = jnp.asarray(teacher_logits_V, jnp.float32)[None]
    student_1xV = jnp.asarray(student_logits_V, jnp.float32)[None]
    soft = losses.kl_distillation_per_example(
        student_1xV, teacher_1xV, jnp.zeros((1,), jnp.int32), jnp.ones((1,)),
        temperature=float(temperature), alpha=1.0,
    )
    return float(soft) / float(temperature) ** 2


def plot_temperature(ax, teacher_logits_V, student_logits_V, temperature: float) -> float:
    """Draw softmax(teacher / T) and softmax(student / T) over the vocabulary.

    Draws two lines (teacher first, then student) on `ax`, which is cleared first,
    and returns KL(teacher_T || student_T), the value shown in the title next to
    T^2 * KL, the soft term the distillation loss uses.
    """
    p_teacher = softmax_at(teacher_logits_V, temperature)
    p_student = softmax_at(student_logits_V, temperature)
    kl = kl_at(teacher_logits_V, student_logits_V, temperature)
    ax.clear()
    x = np.arange(p_teacher.shape[-1])
    ax.plot(x, p_teacher, drawstyle="steps-mid", color="C0", label="teacher")
    ax.plot(x, p_student, drawstyle="steps-mid", color="C1", label="student")
    ax.fill_between(x, p_teacher, step="mid", color="C0", alpha=0.2)
    ax.set_xlabel("token id (vocabulary index)")
    ax.set_ylabel("probability")
    ax.set_title(f"Teacher and student at T = {temperature:g}\n"
                 f"KL(teacher‖student) = {kl:.4f}, T²·KL = {temperature**2 * kl:.4f}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8)
    return kl


def plot_ratio_curve(
    ax,
    batch_sizes: Sequence[int],
    ratios: Mapping[str, Sequence[float]],
    *,
    title: str = "Time ratios over batch size",
    ylabel: str = "time ratio (×, log scale)",
) -> list:
    """Plot one line per named ratio against batch size, on log-log axes.

    A dashed line at 1 marks "equally fast". Returns the drawn lines, one per ratio.
    """
    lines = []
    for label, values in ratios.items():
        if len(values) != len(batch_sizes):
            raise ValueError(
                f"ratio {label!r} has {len(values)} values but there are "
                f"{len(batch_sizes)} batch sizes: give one ratio per batch size"
            )
        (line,) = ax.plot(batch_sizes, values, marker="o", label=label)
        lines.append(line)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(batch_sizes), [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size B (examples)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return lines


_LINESTYLES = ("-", "--", ":", "-.")  # so that overlapping fits stay distinguishable


def plot_divergence_fits(
    ax,
    teacher_probs_V,
    fits: Mapping[str, np.ndarray],
    *,
    title: str = "A one-bump student fitted to a two-mode teacher",
) -> list:
    """The teacher distribution (shaded) and one line per fitted student distribution.

    `fits` maps a label (e.g. "forward KL") to a probability vector over the same
    bins. Returns the student lines, in the order of `fits`.
    """
    teacher = np.asarray(teacher_probs_V)
    x = np.arange(teacher.shape[-1])
    ax.fill_between(x, teacher, step="mid", color="gray", alpha=0.35, label="teacher")
    lines = []
    for i, (label, probs) in enumerate(fits.items()):
        (line,) = ax.plot(x, np.asarray(probs), drawstyle="steps-mid", color=f"C{i}",
                          linestyle=_LINESTYLES[i % len(_LINESTYLES)], linewidth=2, label=label)
        lines.append(line)
    ax.set_xlabel("bin (a 1-D vocabulary)")
    ax.set_ylabel("probability")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return lines


def plot_grad_norms(ax, norms_B, *, clip_norm: float | None = None,
                    title: str = "Per-example gradient norms") -> list:
    """One bar per example's gradient norm; a dashed line at `clip_norm` if given.

    Returns the bars (a matplotlib BarContainer's patches).
    """
    norms = np.asarray(norms_B)
    bars = ax.bar(np.arange(norms.shape[0]), norms, color="C0")
    if clip_norm is not None:
        ax.axhline(clip_norm, color="C3", linestyle="--", linewidth=1,
                   label=f"clip norm = {clip_norm:.3g}")
        ax.legend(fontsize=8)
    ax.set_xlabel("example in the batch")
    ax.set_ylabel("‖∂ loss_b / ∂ params‖₂")
    ax.set_title(title, fontsize=10)
    return list(bars)


def _curve(history, key):
    return [h["step"] for h in history], [h[key] for h in history]


def plot_training(history, *, title: str, eval_key: str = "eval/exact_match"):
    """Loss, gradient norm and an eval metric over training steps, side by side.

    `history`: per-step metric dicts from `train.run`; steps that ran the eval carry
    `eval_key` (exact match as a fraction).
    """
    fig, (ax_loss, ax_norm, ax_em) = plt.subplots(1, 3, figsize=(11, 3))
    ax_loss.plot(*_curve(history, "loss"))
    ax_loss.set(title="training loss", xlabel="step", ylabel="NLL per answer token (nats)", yscale="log")
    ax_norm.plot(*_curve(history, "grad_norm"))
    ax_norm.set(title="gradient norm (before clipping)", xlabel="step", ylabel="global L2 norm")
    evals = [h for h in history if eval_key in h]
    ax_em.plot([h["step"] for h in evals], [100 * h[eval_key] for h in evals], marker="o")
    ax_em.set(title="eval exact match", xlabel="step", ylabel="accuracy (%)", ylim=(0, 100))
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_errors_by_position(models: dict, *, title: str):
    """Token error rate by position in the answer, teacher-forced against free-running.

    `models`: {label: `evaluate.errors_by_position(...)`}. A solid line is the model's
    own greedy answer (free-running), a dashed one the same model after the right
    prefix (teacher-forced): the gap between them is the exposure bias.
    """
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for i, (label, errors) in enumerate(models.items()):
        k = np.arange(len(errors["free_running"]))
        ax.plot(k, 100 * errors["free_running"], color=f"C{i}", marker="o", label=f"{label}: own prefix")
        ax.plot(k, 100 * errors["teacher_forced"], color=f"C{i}", ls="--", marker=".", label=f"{label}: right prefix")
    ax.set(title=title, xlabel="position in the answer (0 = first token)", ylabel="token error (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------- DPO


def dpo_loss_curve(h_N, beta: float, loss_type: str, label_smoothing: float = 0.0):
    """Per-pair DPO loss and gradient weight at each margin h -> (loss_N, weight_N).

    h = (pi_c - pi_r) - (ref_c - ref_r) is the log-ratio margin of one preference
    pair (nats). The loss is `tunix_nb.losses.dpo_loss` of a one-pair batch with
    pi_c = h and the other three log-probs 0 (dpo_loss averages over the batch, so it
    is vmapped over points, one pair each); the weight is -d loss / d h (`jax.grad`,
    vmapped): how hard a pair at margin h pushes the policy's margin up. Closed forms:

        "sigmoid": beta * sigmoid(-beta h)     (eps = label_smoothing = 0)
        "ipo":     -2 (h - 1/(2 beta))          (negative past the target: pulls back)
        "hinge":   beta where beta h < 1, else 0

    Returns float64 NumPy arrays with the shape of `h_N`.
    """
    import jax.numpy as jnp


    _check_dpo_args(beta, loss_type)
    h = np.asarray(h_N, dtype=np.float64)
    # label_smoothing stays a Python float, so dpo_loss checks it when this traces.
    curve = _dpo_curve_fn(loss_type, float(label_smoothing))
    loss_flat, weight_flat = curve(jnp.asarray(h.reshape(-1), jnp.float32),
                                   jnp.float32(beta))
    return (np.asarray(loss_flat, np.float64).reshape(h.shape),
            np.asarray(weight_flat, np.float64).reshape(h.shape))


_DPO_CURVE_FNS: dict = {}  # (loss_type, label_smoothing) -> jitted curve


def _dpo_curve_fn(loss_type: str, label_smoothing: float):
    """A jitted h_N, beta -> (loss_N, -dloss/dh_N), one per (loss type, smoothing).

    beta is a traced argument (dpo_loss checks only Python numbers), so moving the
    explorer's beta slider reuses the compiled function instead of retracing.
    """
    key = (loss_type, label_smoothing)
    if key not in _DPO_CURVE_FNS:
        _DPO_CURVE_FNS[key] = _make_dpo_curve_fn(loss_type, label_smoothing)
    return _DPO_CURVE_FNS[key]


def _make_dpo_curve_fn(loss_type: str, label_smoothing: float):
    import jax
    import jax.numpy as jnp

    from tunix_nb import losses

    def loss_at(h_scalar, beta):
        zero_1 = jnp.zeros((1,), jnp.float32)
        loss, _ = losses.dpo_loss(h_scalar[None], zero_1, zero_1, zero_1, beta=beta,
                                  loss_type=loss_type, label_smoothing=label_smoothing)
        return loss  # the mean over a one-pair batch: that pair's loss

    def curve(h_N, beta):
        loss_N = jax.vmap(loss_at, in_axes=(0, None))(h_N, beta)
        weight_N = -jax.vmap(jax.grad(loss_at), in_axes=(0, None))(h_N, beta)
        return loss_N, weight_N

    return jax.jit(curve)


def _check_dpo_args(beta, loss_type):
    from tunix_nb import losses

    if loss_type not in losses.DPO_LOSS_TYPES:
        raise ValueError(
            f"unknown DPO loss_type {loss_type!r}: choose one of {losses.DPO_LOSS_TYPES}"
        )
    if not isinstance(beta, (int, float, np.integer, np.floating)) or not beta > 0:
        raise ValueError(f"beta must be a number > 0, got {beta!r}")


def plot_dpo_loss(ax, beta: float, loss_type: str, h_range=(-20, 20), *,
                  label_smoothing: float = 0.0, num_points: int = 401) -> dict:
    """Draw the DPO loss and its gradient weight -dL/dh against the margin h.

    The loss (solid, left y-axis of `ax`) and the weight (dashed, on a twin y-axis
    on the right) over `num_points` margins in `h_range`, plus a vertical line at
    h = 0 (policy == reference, where training starts). Both axes are cleared first,
    so redrawing does not stack lines; the twin is made on the first call and kept
    on `ax` (as `ax._dpo_twin_ax`), so later calls on the same `ax` reuse it.

    Returns {"h", "loss", "weight"} (the drawn arrays), "loss_line", "weight_line",
    "zero_line" (the artists) and "twin_ax".
    """
    _check_dpo_args(beta, loss_type)
    if len(h_range) != 2 or not h_range[0] < 0 < h_range[1]:
        raise ValueError(f"h_range must be (low, high) with low < 0 < high, got {h_range!r}")
    h = np.linspace(float(h_range[0]), float(h_range[1]), int(num_points))
    loss, weight = dpo_loss_curve(h, beta, loss_type, label_smoothing)

    twin = getattr(ax, "_dpo_twin_ax", None)
    if twin is None or twin.figure is not ax.figure or twin not in ax.figure.axes:
        twin = ax.twinx()
        ax._dpo_twin_ax = twin
    ax.clear()
    twin.clear()
    # clear() resets what twinx() set up: put the twin's labels back on the right and
    # keep its background transparent so it doesn't hide the loss curve.
    twin.yaxis.tick_right()
    twin.yaxis.set_label_position("right")
    twin.yaxis.set_offset_position("right")
    twin.patch.set_visible(False)

    (loss_line,) = ax.plot(h, loss, color="C0", linewidth=2, label="loss")
    zero_line = ax.axvline(0.0, color="gray", linestyle=":", linewidth=1,
                           label="h = 0: policy = reference")
    (weight_line,) = twin.plot(h, weight, color="C1", linestyle="--", linewidth=2,
                               label="gradient weight −dL/dh")
    twin.axhline(0.0, color="C1", linewidth=0.5, alpha=0.5)
    ax.set_xlim(h[0], h[-1])
    ax.set_xlabel("margin h = Δ log-ratio (nats)")
    ax.set_ylabel("loss", color="C0")
    twin.set_ylabel("gradient weight −dL/dh", color="C1")
    smoothing = f", ε = {label_smoothing:g}" if label_smoothing else ""
    ax.set_title(f"DPO loss_type = {loss_type!r}, β = {beta:g}{smoothing}", fontsize=10)
    # On the twin, which is drawn above `ax`, so the dashed weight line can't cross it.
    twin.legend(handles=[loss_line, weight_line, zero_line], loc="upper right", fontsize=8)
    return {"h": h, "loss": loss, "weight": weight, "loss_line": loss_line,
            "weight_line": weight_line, "zero_line": zero_line, "twin_ax": twin}


def plot_dpo_training(history, *, title: str):
    """DPO training loss, and held-out loss, reward accuracy and margin (from `eval/` keys)."""
    fig, (ax_loss, ax_acc, ax_margin) = plt.subplots(1, 3, figsize=(11, 3))
    evals = [h for h in history if "eval/loss" in h]
    eval_steps = [h["step"] for h in evals]
    ax_loss.plot(*_curve(history, "loss"), alpha=0.6, label="training batches")
    ax_loss.plot(eval_steps, [h["eval/loss"] for h in evals], marker="o", label="held-out pairs")
    ax_loss.axhline(np.log(2), color="gray", linestyle=":", label="ln 2 (policy = reference)")
    ax_loss.set(title="DPO loss", xlabel="step", ylabel="loss per pair (nats)")
    ax_loss.legend(fontsize=8)
    ax_acc.plot(eval_steps, [100 * h["eval/rewards/accuracy"] for h in evals], marker="o")
    ax_acc.set(title="held-out reward accuracy", xlabel="step", ylabel="chosen reward > rejected (%)",
               ylim=(0, 100))
    ax_margin.plot(eval_steps, [h["eval/rewards/margin"] for h in evals], marker="o")
    ax_margin.set(title="held-out reward margin", xlabel="step", ylabel="β·h (nats)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_logps(ax, history, *, title: str):
    """The policy's mean log-probs of chosen and rejected answers over training steps."""
    lines = [ax.plot(*_curve(history, f"logps/{side}"), label=side)[0] for side in ("chosen", "rejected")]
    ax.set(title=title, xlabel="step", ylabel="log-prob of the answer (nats)")
    ax.legend()
    return lines


def bench_figures(results: dict) -> dict:
    """The figures of a `python -m tunix_nb.bench` result: {file name: matplotlib Figure}."""
    figures, out = results["figures"], {}
    where = f"{results['machine']['backend']} · {results['machine']['device_kind']} · " \
            f"{results['machine']['cpu_count']} CPU cores"

    def save(fig, name):
        out[name] = fig

    if "vmap_speedup_over_loop" in figures:
        curve = figures["vmap_speedup_over_loop"]["curve"]
        sizes = sorted(int(b) for b in curve)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(sizes, [curve[str(b) if str(b) in curve else b]["loop_over_vmap"] for b in sizes], marker="o",
                label="Python loop / vmap")
        ax.plot(sizes, [curve[str(b) if str(b) in curve else b]["vmap_over_batched"] for b in sizes], marker="s",
                label="vmap / hand-batched")
        ax.axhline(1.0, color="gray", linestyle=":")
        ax.set(xscale="log", yscale="log", xlabel="batch size B (examples)", ylabel="time ratio",
               title=f"Per-example KL loss: loop vs vmap vs batched\n{where}")
        ax.legend()
        save(fig, "vmap_speedup.png")
    if "dp_overhead" in figures:
        table = figures["dp_overhead"]["per_strategy"]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for mode, by_n in table.items():
            ns = sorted(int(n) for n in by_n)
            ax.plot(ns, [by_n[str(n) if str(n) in by_n else n] for n in ns], marker="o", label=mode)
        ax.axhline(1.0, color="gray", linestyle=":", label="jit, 1 device")
        ax.axhline(figures["dp_overhead"]["target"], color="red", linestyle="--", label="target")
        ax.set(xscale="log", xlabel="devices", ylabel="step time / 1-device jit step",
               title=f"Data-parallel SFT step, same global batch (64)\n{where}")
        ax.legend()
        save(fig, "dp_overhead.png")
    if "allreduce_share" in figures and figures["allreduce_share"].get("share_by_global_batch"):
        a = figures["allreduce_share"]
        curve = {int(b): v for b, v in a["share_by_global_batch"].items()}
        sizes = sorted(curve)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.errorbar(sizes, [100 * curve[b]["share"] for b in sizes],
                    yerr=_iqr_bars([curve[b].get("share_spread") for b in sizes], scale=100),
                    marker="o", capsize=3, label="all-reduce share (median, IQR)")
        ax.axhline(100 * a["target"], color="red", linestyle="--", label="target")
        ax.set(xscale="log", xlabel="global batch (sequences)", ylabel="% of the pmap step",
               title=f"Gradient all-reduce on {a['devices']} devices\n{where}")
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.legend()
        save(fig, "allreduce_share.png")
    summary = [(n, f) for n, f in figures.items() if f.get("target") is not None]
    if summary:
        fig, ax = plt.subplots(figsize=(7, 0.45 * len(summary) + 1))
        names = [n for n, _ in summary]
        ratios = [f["value"] / f["target"] for _, f in summary]
        colors = ["tab:green" if f["meets_target"] else "tab:red" for _, f in summary]
        ax.barh(names, ratios, color=colors,
                xerr=_iqr_bars([f.get("spread") for _, f in summary], scale=[1 / f["target"] for _, f in summary]))
        ax.axvline(1.0, color="black", linestyle=":")
        ax.set(xlabel="figure / its target (green: meets it; bars: interquartile range)",
               title=f"Benchmark figures against targets\n{where}")
        save(fig, "targets.png")
    return out


def _iqr_bars(spreads, scale=1.0):
    """Error bars [[below], [above]] from the median to the quartiles (0 where none)."""
    scales = scale if isinstance(scale, list) else [scale] * len(spreads)
    below = [0.0 if s is None else k * (s["median"] - s["q25"]) for s, k in zip(spreads, scales)]
    above = [0.0 if s is None else k * (s["q75"] - s["median"]) for s, k in zip(spreads, scales)]
    return [below, above]


def save_bench_plots(results: dict, out_dir) -> list:
    """Write the benchmark figures as PNG files into out_dir; returns their paths."""
    from pathlib import Path

    paths = []
    for name, fig in bench_figures(results).items():
        paths.append(Path(out_dir) / name)
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths
