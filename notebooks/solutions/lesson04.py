"""Lesson 04 (DPO, data-parallel with pmap): hinge and IPO, label smoothing, a larger beta.

The lesson's setting: the SFT'd student shipped in `data/sft_student` is both the
policy's start and the frozen reference, whose log-probs are cached once; batches of
32 pairs; AdamW at 1e-3. The lesson trains 200 steps; the defaults here train a few,
enough to see the direction of each effect (pass steps=200 for the lesson's runs).
The loss type's weights and beta reach the step as traced values, so one compiled
step serves every variant (`dpo_family_objective`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tunix_nb import checkpoint, data, dpo, evaluate, losses, train
from tunix_nb.tokenizer import ByteTokenizer

# ------------------------------------------------------------------ the loss, per pair


def gradient_weight(h_K, *, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    """-dL/dh at each margin of h_K [K]: how hard a pair with that margin pushes (the explorer's curve).

    One pair per margin, so `losses.dpo_loss` (a mean over pairs) is K times each pair's loss.
    """
    return -_loss_and_grad(jnp.asarray(h_K, jnp.float32), beta, loss_type, label_smoothing)[1]


def pair_loss(h_K, *, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    """The loss of one pair at each margin of h_K [K] -> [K]."""
    return _loss_and_grad(jnp.asarray(h_K, jnp.float32), beta, loss_type, label_smoothing)[0]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _loss_and_grad(h_K, beta, loss_type, label_smoothing):
    """Per-pair losses [K] and dL/dh [K], one pair per margin."""
    def one(h):
        zeros = jnp.zeros((1,))
        loss, _ = losses.dpo_loss(h[None], zeros, zeros, zeros, beta=beta, loss_type=loss_type,
                                  label_smoothing=label_smoothing)
        return loss

    return jax.vmap(jax.value_and_grad(one))(h_K)


# ------------------------------------------------------------------ training runs


@functools.lru_cache(maxsize=1)
def lesson_setup():
    """(graphdef, sft_params, eval_examples, pair_rows): the lesson's policy and data, loaded once."""
    graphdef, sft_params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    eval_examples = data.load_sft(data.DATA_DIR / "sft_eval.jsonl")
    tok = ByteTokenizer()
    pair_rows = {"train": data.preference_arrays(data.load_preferences(), tok, data.DEFAULT_SEQ_LEN),
                 "eval": data.preference_arrays(data.load_preferences(data.DATA_DIR / "preferences_eval.jsonl"),
                                                tok, data.DEFAULT_SEQ_LEN)}
    return graphdef, sft_params, eval_examples, pair_rows


@functools.lru_cache(maxsize=1)
def cached_pairs():
    """{"train", "eval"} pair arrays with the reference's cached summed log-probs."""
    graphdef, sft_params, _, pair_rows = lesson_setup()
    return {split: dpo.reference_log_probs(graphdef, sft_params, rows, batch_size=200)
            for split, rows in pair_rows.items()}


def dpo_family_objective(graphdef):
    """(params, batch, knobs) -> (sum of pair losses, B, metrics): every loss of the lesson in one program.

    knobs (traced, so one compiled step serves every setting): "beta", and the weights
    "sigmoid", "hinge" and "ipo" of `losses.dpo_loss` with that loss_type. Sigmoid and
    hinge see summed log-probs; IPO sees them divided by the answer lengths, as
    `dpo.objective(..., loss_type="ipo", length_normalize=True)` feeds it.
    """

    def objective(params, batch, knobs):
        pi_c, pi_r = dpo.pair_log_probs(graphdef, params, batch)
        ref_c, ref_r = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        n_c, n_r = (jnp.maximum(batch[f"{side}_loss_mask"].sum(-1), 1.0) for side in ("chosen", "rejected"))
        beta = knobs["beta"]
        loss = knobs["sigmoid"] * losses.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=beta, loss_type="sigmoid")[0]
        loss += knobs["hinge"] * losses.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=beta, loss_type="hinge")[0]
        loss += knobs["ipo"] * losses.dpo_loss(pi_c / n_c, pi_r / n_r, ref_c / n_c, ref_r / n_r, beta=beta,
                                               loss_type="ipo")[0]
        n = pi_c.shape[0]
        return loss * n, jnp.float32(n), {"logps/chosen": jax.lax.stop_gradient(pi_c.mean())}

    return objective


@functools.lru_cache(maxsize=4)
def _dpo_step(steps: int):
    graphdef, _, _, _ = lesson_setup()
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-3, warmup_steps=min(20, steps // 10),
                                                     total_steps=max(steps, 2)))
    return opt, train.make_step(dpo_family_objective(graphdef), opt)


@functools.lru_cache(maxsize=2)
def _scorer(graphdef):
    return jax.jit(functools.partial(dpo.pair_log_probs, graphdef))


def dpo_run(*, beta: float, loss_type: str = "sigmoid", steps: int = 10, batch_size: int = 32,
            exact_match: bool = False) -> dict[str, float]:
    """DPO from the SFT'd student for `steps` steps; what moved, on the 200 held-out pairs.

    `loss_type`: "sigmoid", "hinge" or "ipo" (IPO on length-normalised log-probs).
    Returns "chosen_logp_before"/"chosen_logp_after" (mean summed log-prob of the chosen
    answers), "rejected_logp_before"/"rejected_logp_after", "reward_accuracy" (fraction
    of pairs with h > 0; it does not depend on beta) and, with `exact_match`, the greedy
    "exact_match" on the 200 eval prompts after training.
    """
    graphdef, sft_params, eval_examples, _ = lesson_setup()
    pairs = cached_pairs()
    opt, step_fn = _dpo_step(steps)
    knobs = {name: jnp.float32(name == loss_type) for name in losses.DPO_LOSS_TYPES}
    params, _, _ = train.run(step_fn, sft_params, opt.init(sft_params),
                             lambda s: data.batch_at(pairs["train"], s, batch_size, seed=0),
                             steps=steps, frozen={**knobs, "beta": jnp.float32(beta)}, progress=False)
    score = _scorer(graphdef)
    eval_pairs = pairs["eval"]
    (c0, r0), (c1, r1) = score(sft_params, eval_pairs), score(params, eval_pairs)
    c0, r0, c1, r1 = (np.asarray(x) for x in (c0, r0, c1, r1))
    h = (c1 - r1) - (eval_pairs["ref_chosen_logps"] - eval_pairs["ref_rejected_logps"])
    out = {"chosen_logp_before": float(c0.mean()), "chosen_logp_after": float(c1.mean()),
           "rejected_logp_before": float(r0.mean()), "rejected_logp_after": float(r1.mean()),
           "reward_accuracy": float(np.mean(h > 0))}
    if exact_match:
        out["exact_match"] = evaluate.exact_match_accuracy(graphdef, params, eval_examples)
    return out


# ------------------------------------------------------------------------- exercise 1


def hinge_and_ipo_against_sigmoid(steps: int = 10, *, beta: float = 0.1, ipo_beta: float = 0.5,
                                  exact_match: bool = False) -> dict:
    """Lesson 04, exercise 1: the hinge and IPO losses against DPO's sigmoid.

    "weights": -dL/dh (per pair) of the hinge at beta h = 0.5, 0.99, 1.01 and 2 (keys
    "hinge@0.5", ...), and of IPO at h = 1/(2 ipo_beta) - 1, the target, and target + 1
    ("ipo@below", "ipo@target", "ipo@above"). "runs": `dpo_run` results after `steps`
    steps for "sigmoid" and "hinge" (beta) and "ipo" (ipo_beta, length-normalised
    log-probs).
    """
    weights = {}
    for bh in (0.5, 0.99, 1.01, 2.0):
        weights[f"hinge@{bh}"] = float(gradient_weight([bh / beta], beta=beta, loss_type="hinge")[0])
    target = 1 / (2 * ipo_beta)
    for name, h in (("below", target - 1), ("target", target), ("above", target + 1)):
        weights[f"ipo@{name}"] = float(gradient_weight([h], beta=ipo_beta, loss_type="ipo")[0])
    runs = {"sigmoid": dpo_run(beta=beta, steps=steps, exact_match=exact_match),
            "hinge": dpo_run(beta=beta, loss_type="hinge", steps=steps, exact_match=exact_match),
            "ipo": dpo_run(beta=ipo_beta, loss_type="ipo", steps=steps, exact_match=exact_match)}
    return {"weights": weights, "runs": runs}


# ------------------------------------------------------------------------- exercise 2


def label_smoothing_effects(eps: float = 0.2, beta: float = 0.1, large_h: float = 200.0) -> dict[str, float]:
    """Lesson 04, exercise 2: conservative DPO, label smoothing eps, at h = 0 and at a large h.

    Returns "loss_at_0" (one pair at h = 0; ln 2 whatever eps), "weight_at_large_h"
    (-dL/dh at h = `large_h`, beta h = 20: -eps beta, negative), "weight_at_large_h_eps0"
    (the same without smoothing: about 0) and "weight_at_0" (beta (1 - 2 eps) / 2).
    """
    return {"loss_at_0": float(pair_loss([0.0], beta=beta, label_smoothing=eps)[0]),
            "weight_at_0": float(gradient_weight([0.0], beta=beta, label_smoothing=eps)[0]),
            "weight_at_large_h": float(gradient_weight([large_h], beta=beta, label_smoothing=eps)[0]),
            "weight_at_large_h_eps0": float(gradient_weight([large_h], beta=beta)[0])}


# ------------------------------------------------------------------------- exercise 3


def larger_beta_chosen_logps(steps: int = 10, betas=(0.1, 0.5), exact_match: bool = False) -> dict:
    """Lesson 04, exercise 3: DPO (sigmoid, no SFT term) with beta = 0.5 against 0.1.

    {beta: `dpo_run` result after `steps` steps} for each beta in `betas`; compare
    "chosen_logp_after" with "chosen_logp_before" (and "exact_match" with `exact_match`).
    """
    return {beta: dpo_run(beta=beta, steps=steps, exact_match=exact_match) for beta in betas}

