"""Lesson 02 (distilling a student from a teacher): alpha's endpoints, temperature, reverse KL.

The lesson's setting: the shipped teacher (`data/teacher`), a transfer set of 1000
fresh prompts (seed 777) the students train on, and the 200 eval prompts. The lesson
trains the `student` preset for 300 steps of 64; the defaults here train the `tiny`
preset for a few dozen steps of 32, enough to see the direction of each effect. Pass
`preset="student", steps=300, batch_size=64` for the lesson's runs (minutes on a CPU).

Two economies keep these fast, without changing what is computed. The teacher is
frozen, so its logits for the transfer set are computed once and handed to each step
with the batch, as lesson 04 caches the reference. And the loss's settings (T, alpha,
forward or reverse KL) reach the step as traced values in its `frozen` argument, so
one compiled step serves every setting.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tunix_nb import data, distill, evaluate, losses, model, sft, train
from tunix_nb.batching import map_in_chunks
from tunix_nb.tokenizer import ByteTokenizer


@functools.lru_cache(maxsize=1)
def lesson_setup():
    """(teacher_graphdef, teacher_params, transfer_rows, eval_examples, eval_rows), loaded once.

    transfer_rows holds the four SFT arrays [1000, 24] and the teacher's logits on them,
    "teacher_logits" [1000, 24, 259]; eval_rows the four arrays [200, 24] of the eval set.
    """
    tok = ByteTokenizer()
    teacher_graphdef, teacher_params = distill.load_teacher()
    eval_examples = data.load_sft(data.DATA_DIR / "sft_eval.jsonl")
    eval_rows = data.sft_arrays(eval_examples, tok, data.DEFAULT_SEQ_LEN)
    known = [e["prompt"] for e in data.load_sft() + eval_examples]
    transfer = data.generate_sft(1000, seed=777, exclude=known)  # prompts the teacher never saw
    transfer_rows = data.sft_arrays(transfer, tok, data.DEFAULT_SEQ_LEN)
    transfer_rows["teacher_logits"] = teacher_logits(teacher_graphdef, teacher_params, transfer_rows)
    return teacher_graphdef, teacher_params, transfer_rows, eval_examples, eval_rows


def teacher_logits(graphdef, params, rows, chunk: int = 200) -> np.ndarray:
    """The frozen teacher's logits [N, L, V] for rows [N, L], in chunks of one compiled shape."""
    apply = jax.jit(model.apply, static_argnums=0)
    return map_in_chunks(lambda b: apply(graphdef, params, b["inputs"], b["attention_mask"]), rows, chunk)


def cached_teacher_objective(student_graphdef):
    """(params, batch with "teacher_logits", knobs) -> (sum of per-example losses, B, {}).

    knobs = {"temperature", "alpha", "reverse"} (arrays, so they are traced): reverse=0
    gives `losses.kl_distillation_per_example` (alpha * T² KL(teacher||student) +
    (1 - alpha) * CE), reverse=1 gives `losses.reverse_kl_per_example` (T² KL(student||
    teacher), no CE term), each vmapped over the batch [B, L, V] and summed.
    """

    def objective(params, batch, knobs):
        s = model.apply(student_graphdef, params, batch["inputs"], batch["attention_mask"])
        t = batch["teacher_logits"]
        T, alpha, reverse = knobs["temperature"], knobs["alpha"], knobs["reverse"]
        args = (s, t, batch["targets"], batch["loss_mask"])
        forward = functools.partial(losses.kl_distillation_per_example, temperature=T, alpha=alpha)
        reverse_kl = functools.partial(losses.reverse_kl_per_example, temperature=T)
        forward_B, reverse_B = jax.vmap(forward)(*args), jax.vmap(reverse_kl)(*args)
        loss_B = (1 - reverse) * forward_B + reverse * reverse_B
        return loss_B.sum(), jnp.float32(loss_B.shape[0]), {}

    return objective


def knobs(temperature=2.0, alpha=0.5, reverse=False) -> dict:
    """The settings of `cached_teacher_objective`, as arrays (traced inside the step)."""
    return {"temperature": jnp.float32(temperature), "alpha": jnp.float32(alpha), "reverse": jnp.float32(reverse)}


@functools.lru_cache(maxsize=4)
def _student_step(preset: str, steps: int):
    """(graphdef, initial params, optimizer, compiled step) of a fresh student (seed 0)."""
    graphdef, params0 = model.split(model.make_model(preset, seed=0))
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=3e-3, warmup_steps=min(20, steps // 10),
                                                     total_steps=max(steps, 2)))
    return graphdef, params0, opt, train.make_step(cached_teacher_objective(graphdef), opt)


def train_student(*, preset: str, steps: int, batch_size: int, temperature=2.0, alpha=0.5, reverse=False,
                  data_seed: int = 0):
    """A student (seed 0) trained `steps` steps on the transfer set -> (graphdef, params).

    The loss settings are those of `cached_teacher_objective`; `data_seed` orders the
    batches (`data.batch_at`). A run is a pure function of its arguments, so each is
    trained once per process and then reused.
    """
    return _trained(preset, steps, batch_size, float(temperature), float(alpha), bool(reverse), int(data_seed))


@functools.lru_cache(maxsize=16)
def _trained(preset, steps, batch_size, temperature, alpha, reverse, data_seed):
    graphdef, params0, opt, step_fn = _student_step(preset, steps)
    _, _, transfer_rows, _, _ = lesson_setup()
    params, _, _ = train.run(step_fn, params0, opt.init(params0),
                             lambda s: data.batch_at(transfer_rows, s, batch_size, seed=data_seed), steps=steps,
                             frozen=knobs(temperature, alpha, reverse), progress=False)
    return graphdef, params


def _eval_loss_and_entropy(graphdef, params, rows) -> tuple[float, float]:
    """(token-mean NLL of the answers, as `sft.eval_loss`; mean entropy in nats of the
    model's next-token distribution at the answer tokens), over rows [N, L]."""
    arrays = {k: rows[k] for k in ("inputs", "targets", "loss_mask", "attention_mask")}
    loss, entropy = _loss_and_entropy(graphdef, params, arrays)
    return float(loss), float(entropy)


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_entropy(graphdef, params, rows):
    logits_BxLxV = model.apply(graphdef, params, rows["inputs"], rows["attention_mask"])
    nll_sum, count = losses.sft_loss(logits_BxLxV, rows["targets"], rows["loss_mask"])
    logp = jax.nn.log_softmax(logits_BxLxV, axis=-1)
    entropy_BxL = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return nll_sum / count, jnp.sum(entropy_BxL * rows["loss_mask"]) / count


# ------------------------------------------------------------------------- exercise 1


def _rows_of_one_length(rows, n):
    """n rows whose answers (with eos) all have the most common number of tokens."""
    lengths = rows["loss_mask"].sum(-1).astype(int)
    idx = np.flatnonzero(lengths == np.bincount(lengths).argmax())[:n]
    return {k: v[idx] for k, v in rows.items()}


def alpha_endpoints(steps: int = 30, preset: str = "tiny", batch_size: int = 32) -> dict[str, float]:
    """Lesson 02, exercise 1: the alpha=0 loss against SFT's, and a student trained with alpha=1.

    At the student's initial parameters, on a batch [batch_size, 24] of the transfer set
    whose answers have different lengths ("uneven") and on one whose answers all have the
    same length ("equal"): "alpha0_*" is the lesson's loss with alpha=0
    (`distill.objective`: token mean per example, then the mean over examples) and
    "sft_*" lesson 03's (`sft.objective`: token mean over the batch). Then a student
    trained `steps` steps on soft labels only (alpha=1, T=2): its eval loss on the 200
    eval prompts before ("alpha1_eval_before") and after ("alpha1_eval_after").
    """
    teacher_graphdef, _, transfer_rows, _, eval_rows = lesson_setup()
    graphdef, params0, _, _ = _student_step(preset, steps)
    hard_only = distill.objective(graphdef, teacher_graphdef, alpha=0.0)  # never runs the teacher
    sft_objective = sft.objective(graphdef)
    both = jax.jit(lambda p, b: (hard_only(p, b, None)[:2], sft_objective(p, b)[:2]))
    out = {}
    for name, batch in (("uneven", data.batch_at(transfer_rows, 0, batch_size, seed=0)),
                        ("equal", _rows_of_one_length(transfer_rows, batch_size))):
        (loss_sum, n), (nll_sum, count) = both(params0, {k: v for k, v in batch.items() if k != "teacher_logits"})
        out[f"alpha0_{name}"], out[f"sft_{name}"] = float(loss_sum / n), float(nll_sum / count)
    graphdef, params = train_student(preset=preset, steps=steps, batch_size=batch_size, temperature=2.0, alpha=1.0)
    out["alpha1_eval_before"] = _eval_loss_and_entropy(graphdef, params0, eval_rows)[0]
    out["alpha1_eval_after"] = _eval_loss_and_entropy(graphdef, params, eval_rows)[0]
    return out


# ------------------------------------------------------------------------- exercise 2


def temperature_sweep(temperatures=(1.0, 2.0, 4.0), *, steps: int = 0, preset: str = "tiny",
                      batch_size: int = 32) -> dict[float, dict[str, float]]:
    """Lesson 02, exercise 2: what the temperature T changes, for each T in `temperatures`.

    From the teacher's logits [1000, 24, 259] on the transfer set, over answer tokens:
    "teacher_target_prob" (mean probability of the correct token at T: how clearly the
    soft label still says which answer is right) and "teacher_entropy" (nats: how much
    of its ranking of the other tokens it passes on). At the untrained student's logits
    [64, 24, 259] on 64 transfer rows: "grad_norm", the norm of the soft term T²·KL's
    gradient with respect to them (the parameters' gradient is a fixed linear map of
    it), and "grad_norm_without_T2", that of KL alone. With `steps` > 0 it also trains a student
    (alpha=0.5) at each T and adds its "eval_loss" and "exact_match" on the eval prompts.
    """
    _, _, transfer_rows, eval_examples, eval_rows = lesson_setup()
    graphdef, params0, _, _ = _student_step(preset, max(steps, 30))
    teacher_NxLxV = jnp.asarray(transfer_rows["teacher_logits"])
    m_NxL = jnp.asarray(transfer_rows["loss_mask"])
    batch = data.batch_at(transfer_rows, 0, 64, seed=0)
    apply = jax.jit(model.apply, static_argnums=0)
    student_BxLxV = apply(graphdef, params0, batch["inputs"], batch["attention_mask"])

    @jax.jit
    def teacher_stats(T):
        logp = jax.nn.log_softmax(teacher_NxLxV / T, axis=-1)
        target_logp = jnp.take_along_axis(logp, jnp.asarray(transfer_rows["targets"])[..., None], -1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return jnp.sum(jnp.exp(target_logp) * m_NxL) / m_NxL.sum(), jnp.sum(entropy * m_NxL) / m_NxL.sum()

    @jax.jit
    def soft_grad_norm(student, teacher, targets, mask, T):  # of the batch mean of T² KL, w.r.t. the logits
        def soft(s):
            return losses.distillation_loss(s, teacher, targets, mask, temperature=T, alpha=1.0)[0]
        return jnp.linalg.norm(jax.grad(soft)(student))

    out = {}
    for T in temperatures:
        target_prob, entropy = teacher_stats(jnp.float32(T))
        g = float(soft_grad_norm(student_BxLxV, batch["teacher_logits"], batch["targets"], batch["loss_mask"],
                                 jnp.float32(T)))
        out[T] = {"teacher_target_prob": float(target_prob), "teacher_entropy": float(entropy),
                  "grad_norm": g, "grad_norm_without_T2": g / T**2}
        if steps:
            g_def, params = train_student(preset=preset, steps=steps, batch_size=batch_size, temperature=T,
                                          alpha=0.5)
            out[T]["eval_loss"] = _eval_loss_and_entropy(g_def, params, eval_rows)[0]
            out[T]["exact_match"] = evaluate.exact_match_accuracy(g_def, params, eval_examples)
    return out


# ------------------------------------------------------------------------- exercise 3


def reverse_vs_forward_kl_students(steps: int = 30, preset: str = "tiny",
                                   batch_size: int = 32) -> dict[str, dict[str, float]]:
    """Lesson 02, exercise 3: a student trained with forward KL against one with reverse KL.

    Both soft-only at T=2 (forward: `kl_distillation_per_example` with alpha=1; reverse:
    `jax.vmap(partial(losses.reverse_kl_per_example, temperature=2.0))`), same seed,
    batches [batch_size, 24] and optimizer, `steps` steps. Returns, for "forward" and
    "reverse": "eval_loss" (token-mean NLL of the eval answers), "exact_match" (only when
    steps >= 100; greedy answers to the 200 eval prompts) and "entropy" (mean entropy in
    nats, at T=1, of the student's next-token distribution at the eval answer tokens:
    lower is more peaked, a student that commits).
    """
    _, _, _, eval_examples, eval_rows = lesson_setup()
    out = {}
    for name, reverse in (("forward", False), ("reverse", True)):
        graphdef, params = train_student(preset=preset, steps=steps, batch_size=batch_size, temperature=2.0,
                                         alpha=1.0, reverse=reverse)
        loss, entropy = _eval_loss_and_entropy(graphdef, params, eval_rows)
        out[name] = {"eval_loss": loss, "entropy": entropy}
        if steps >= 100:
            out[name]["exact_match"] = evaluate.exact_match_accuracy(graphdef, params, eval_examples)
    return out


# ------------------------------------------------------------------------- exercise 4


def distillation_gain_by_data_order(data_seeds=(0, 1, 2, 3), *, steps: int = 30, preset: str = "tiny",
                                    batch_size: int = 32) -> dict[int, dict[str, float]]:
    """Lesson 02, exercise 4: the distilled and the hard-label student under other batch orders.

    For each data seed (`data.batch_at(..., seed=data_seed)`; the lesson uses 0), the
    lesson's two students, same initial parameters and optimizer: "distilled" (alpha=0.5,
    T=2) and "hard" (alpha=0), trained `steps` steps on batches [batch_size, 24] of the
    transfer set. Returns each one's eval loss (token-mean NLL of the 200 eval answers)
    and "gain", hard minus distilled (positive: distillation helped).
    """
    _, _, _, _, eval_rows = lesson_setup()
    out = {}
    for seed in data_seeds:
        losses_by_name = {}
        for name, alpha in (("distilled", 0.5), ("hard", 0.0)):
            graphdef, params = train_student(preset=preset, steps=steps, batch_size=batch_size, temperature=2.0,
                                             alpha=alpha, data_seed=seed)
            losses_by_name[name] = _eval_loss_and_entropy(graphdef, params, eval_rows)[0]
        out[seed] = {**losses_by_name, "gain": losses_by_name["hard"] - losses_by_name["distilled"]}
    return out
