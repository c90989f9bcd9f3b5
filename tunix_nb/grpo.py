"""Group relative policy optimisation (GRPO) with verifiable rewards: rollouts, the batch, the objective.

Tunix: `rl.grpo.grpo_learner.GrpoLearner`; its Dr. GRPO and DAPO learners are settings
here (`estimator="drgrpo"`, the `aggregation`, `epsilon_high`, `beta=0`). One GRPO step:

1. Rollout (`rollout`): B prompts of the SFT data, each repeated G times in a row; the
   current policy samples one completion per row (`sampler.generate`, one key per row:
   `rollout_keys`); the reward functions score them; `losses.group_advantages` compares
   each completion with the other G - 1 of its prompt. In the same pass, once per
   rollout batch and in the policy's compute dtype: the old policy's per-token
   log-probs (only when num_iterations > 1; with one update the policy is the old
   policy, ratio 1, as in TRL) and the frozen reference's (only when beta > 0).
2. μ = num_iterations updates on that batch: `objective` through `train.make_step`
   (`train.run_on_policy` runs both parts, step after step).

What is data-parallel: sampling and the two log-prob forward passes (each device
samples and scores its own rows, whole groups of G, from the params it holds), and the
update (loss sums, weights and gradients all-reduced, as for every method). What is
not: decoding the completions to text, the reward functions and the advantages, which
run in host Python/NumPy on the global batch (as Tunix's reward functions do); they
are cheap next to sampling, but they are a serial step between the two parallel ones.

A rollout is a pure function of (params, prompts, seed, step): row r of step s samples
with `fold_in(fold_in(key(seed), s), r)`, whatever device row r lands on, so 1 device
and 8 draw the same completions, and a run resumed at step s draws what it would have.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunix_nb import data, losses, sampler, vocab_chunks
from tunix_nb import rewards as rewards_lib
from tunix_nb.config_flags import non_negative_float, option, positive_float, positive_int
from tunix_nb.precision import cast_floats, resolve_compute_dtype
from tunix_nb.tokenizer import ByteTokenizer, Tokenizer

# The reward functions the command line can name (`--rewards`).
REWARD_FUNCTIONS = {"exact_match": rewards_lib.exact_match, "char_match": rewards_lib.char_match,
                    "well_formed": rewards_lib.well_formed}
DEFAULT_REWARDS = ("exact_match", "char_match")  # the shipped task's, when --reward-funcs is not given
HF_MAX_NEW_TOKENS = 256  # a Hugging Face model's --max-new-tokens default: TRL's GRPOConfig.max_completion_length


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """`python -m tunix_nb.train grpo`'s own options (TRL's GRPOConfig, Tunix's GrpoConfig); the
    defaults are TRL's and Tunix's where they agree (beta 0.04, epsilon 0.2; G 8 as TRL)."""

    DEFAULT_LEARNING_RATE: ClassVar[float] = 3e-4
    SUMMARY: ClassVar[str] = ("reinforcement learning with verifiable rewards, from an SFT checkpoint: each step "
                              "samples --group-size completions for each of --batch-size prompts, scores them, "
                              "and updates --num-iterations times on them")

    init_from: str | None = option(help="the SFT checkpoint the policy and the frozen reference start from "
                                   "(default: the SFT student shipped in data/sft_student)")
    beta: float = option(0.04, type=non_negative_float, help="weight of the KL penalty to the reference, 0 for none")
    group_size: int = option(8, type=positive_int, help="completions per prompt, G >= 2")
    epsilon: float = option(0.2, type=positive_float, help="clip range of the ratio, below 1")
    epsilon_high: float | None = option(type=positive_float, help="clip range above 1 (DAPO's clip-higher) "
                                        "(default: --epsilon)")
    advantage: str = option("grpo", choices=losses.ADVANTAGE_ESTIMATORS,
                            help="group advantage: grpo (std-normalised), rloo (leave-one-out) or drgrpo (no std)")
    aggregation: str = option("sequence-mean-token-mean", choices=losses.GRPO_AGGREGATIONS,
                              help="how token losses become the loss (TRL's grpo; token-mean is DAPO's, "
                                   "sequence-mean-token-scale Dr. GRPO's)")
    kl_estimator: str = option("low_var_kl", choices=losses.KL_ESTIMATORS,
                               help="per-token KL estimate: kl (k1), mse_kl (k2), low_var_kl (k3)")
    num_iterations: int = option(1, type=positive_int, help="updates per rollout batch, Tunix's "
                                 "num_iterations (mu)")
    temperature: float = option(1.0, type=positive_float, help="sampling temperature, > 0")
    max_new_tokens: int | None = option(type=positive_int, help="tokens sampled per completion; a longer "
                                        "completion is cut and scored as cut (default: 8, the shipped task's "
                                        f"answers; a Hugging Face --model: {HF_MAX_NEW_TOKENS}, TRL's "
                                        "max_completion_length, or half its max_position_embeddings if fewer)")
    rewards: str | None = option(help="comma-separated built-in reward functions, summed: "
                                 f"{', '.join(REWARD_FUNCTIONS)}; they read the data's 'completion' column "
                                 f"(default: {','.join(DEFAULT_REWARDS)}, none with --reward-funcs)")
    reward_funcs: str | None = option(metavar="MODULE:FUNCTION,...", help="your own reward functions, summed "
                                      "with --rewards: TRL's signature fn(prompts, completions, **columns) -> "
                                      "list[float], imported from the module (a dotted name on sys.path or the "
                                      "working directory); each logs rewards/<function>/mean")

    def check(self) -> None:
        """Settings that cannot train: a ValueError naming the flag and the fix."""
        if self.group_size < 2:
            raise ValueError(f"--group-size {self.group_size} must be at least 2: an advantage compares a "
                             "completion with the other completions of its prompt")
        if self.reward_names is None or (not self.reward_names and not self.reward_funcs):
            raise ValueError(f"--rewards {self.rewards!r}: give distinct names from "
                             f"{', '.join(REWARD_FUNCTIONS)}, separated by commas")

    @property
    def reward_names(self) -> list[str] | None:
        """The built-in reward names of --rewards, or None if one is unknown or repeated. Not given: the
        shipped task's rewards, or none beside --reward-funcs (TRL's reward_funcs are the user's alone)."""
        if self.rewards is None:
            return [] if self.reward_funcs else list(DEFAULT_REWARDS)
        names = [n.strip() for n in self.rewards.split(",") if n.strip()]
        if any(n not in REWARD_FUNCTIONS for n in names) or len(set(names)) != len(names):
            return None
        return names


# ------------------------------------------------------------------ prompts, keys, sampling

# On-policy sampling, shared with GKD, lives beside the sampler (`tunix_nb.sampler`); these
# names stay importable from here (lessons 08 and 11 call them as grpo.*).
prompt_rows, rollout_keys, training_rows = sampler.prompt_rows, sampler.rollout_keys, sampler.training_rows
completion_log_probs, make_sampler = sampler.completion_log_probs, sampler.make_sampler


def completion_texts(batch, tokenizer: Tokenizer | None = None) -> list[str]:
    """The sampled completions as text, cut before eos (what the reward functions see)."""
    tokenizer = tokenizer or ByteTokenizer()
    mask_BxT = np.asarray(batch["completion_mask"])
    tokens_BxT = np.asarray(batch["targets"])[:, -mask_BxT.shape[1]:]
    texts = []
    for ids, n in zip(tokens_BxT.tolist(), mask_BxT.sum(axis=1).tolist()):
        ids = ids[:n]
        if ids and ids[-1] == tokenizer.eos_id:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids))
    return texts


# ------------------------------------------------------------------ the rollout


class Rollout(NamedTuple):
    """One rollout batch: the training batch (host arrays, [B * G, ...]), the completions
    as text, their rewards, and the rollout's metrics."""

    batch: dict
    completions: list
    rewards: rewards_lib.Rewards
    metrics: dict


def rollout(sample: Callable, params, reference, prompts: dict, examples: Sequence[dict], key_data,
            reward_set: rewards_lib.RewardSet, *, group_size: int, estimator: str = "grpo",
            tokenizer: Tokenizer | None = None) -> Rollout:
    """Sample G = `group_size` completions for each of B prompts, score them, compute advantages.

    `prompts`: B rows of `prompt_rows` (`prompt_tokens`, `prompt_mask`); `examples`: the
    B examples they come from (their columns, e.g. `completion` and `task`, go to the
    reward functions; `prompt` is their prompt); `key_data`: [B * G, 2] (`rollout_keys`);
    `sample`: from `make_sampler`. Each prompt is repeated G times in a row, so row
    r = b * G + g is prompt b's g-th completion. The batch gains `advantages` [B * G].

    Metrics (TRL's and Tunix's names): "reward", "reward_std", "rewards/{name}/mean" and
    "/std", "frac_reward_zero_std" (`rewards.reward_metrics`), and
    "completions/mean_length", "/min_length", "/max_length" (tokens, eos included).
    """
    G = group_size
    if len(examples) != len(prompts["prompt_tokens"]):
        raise ValueError(f"got {len(prompts['prompt_tokens'])} prompts but {len(examples)} examples: pass the "
                         "examples the prompts were made from, one per prompt")
    batch = sample(params, reference, np.repeat(prompts["prompt_tokens"], G, axis=0),
                   np.repeat(prompts["prompt_mask"], G, axis=0), key_data)
    texts = completion_texts(batch, tokenizer)
    rows = [e for e in examples for _ in range(G)]
    columns = {k: [e[k] for e in rows] for k in rows[0] if k != "prompt"}
    prompt_values = [e["prompt"] for e in rows]
    scored = reward_set(prompt_values, rewards_lib.for_reward_functions(prompt_values, texts), **columns)
    batch["advantages"] = np.asarray(losses.group_advantages(scored.total, G, estimator=estimator))
    lengths = batch["completion_mask"].sum(axis=1)
    metrics = {**rewards_lib.reward_metrics(scored, G), "completions/mean_length": float(lengths.mean()),
               "completions/min_length": float(lengths.min()), "completions/max_length": float(lengths.max())}
    return Rollout(batch, texts, scored, metrics)


def make_rollout(graphdef, examples: Sequence[dict], reward_set: rewards_lib.RewardSet, *, batch_size: int,
                 group_size: int, seed: int, estimator: str = "grpo", num_iterations: int = 1,
                 beta: float = 0.04, max_new_tokens: int = data.MAX_NEW_TOKENS, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, compute_dtype="auto",
                 parallel_mode: str = "jit", mesh=None, tokenizer: Tokenizer | None = None,
                 prompt_len: int = data.DEFAULT_PROMPT_LEN, rows: dict | None = None,
                 vocab_chunk: int | None = None, seq_chunk: int | None = None) -> Callable:
    """`rollout_fn(step, params, reference) -> (batch, metrics)`, for `train.run_on_policy`.

    Step s draws `batch_size` prompts from `examples` (`data.batch_at` with `seed`: each
    epoch visits every example once) and samples G = `group_size` completions each,
    with `rollout_keys(seed, s, batch_size * group_size)`: a pure function of (params,
    seed, step). It computes `old_logps` when `num_iterations > 1` and `ref_logps` when
    `beta > 0`. `parallel_mode` and `mesh` must be the step's (see `make_sampler`);
    `vocab_chunk`/`seq_chunk` should be the objective's. `rows`: the prompts already encoded
    (`user_data.prompt_arrays(...).arrays`, e.g. rendered through a chat template), one per
    example; default `prompt_rows(examples, tokenizer, prompt_len)`.
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}: an advantage compares a "
                         "completion with the other completions of its prompt")
    if estimator not in losses.ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {losses.ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    tokenizer = tokenizer or ByteTokenizer()
    if rows is None:
        rows = prompt_rows(examples, tokenizer, prompt_len)
    elif len(rows["index"]) != len(examples):
        raise ValueError(f"got {len(rows['index'])} encoded prompts for {len(examples)} examples: encode the "
                         "same examples (user_data.prompt_arrays returns both)")
    sample = make_sampler(graphdef, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, old_logps=num_iterations > 1, ref_logps=beta > 0,
                          compute_dtype=compute_dtype, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                          parallel_mode=parallel_mode, mesh=mesh, vocab_chunk=vocab_chunk, seq_chunk=seq_chunk)

    def rollout_fn(step, params, reference):
        picked = data.batch_at(rows, step, batch_size, seed=seed)
        out = rollout(sample, params, reference, picked, [examples[i] for i in picked["index"]],
                      rollout_keys(seed, step, batch_size * group_size), reward_set, group_size=group_size,
                      estimator=estimator, tokenizer=tokenizer)
        return out.batch, out.metrics

    return rollout_fn


# ------------------------------------------------------------------ the objective


def objective(graphdef, *, epsilon=0.2, epsilon_high=None, beta=0.04, kl_estimator="low_var_kl",
              aggregation="sequence-mean-token-mean", max_completion_length=None, compute_dtype="auto",
              vocab_chunk=None, seq_chunk=None):
    """(policy params, rollout batch, frozen) -> (loss sum, weight, metrics), by `losses.grpo_loss`.

    The policy's per-token log-probs of the completions (`completion_log_probs`, in
    `compute_dtype`) against the batch's `old_logps` (absent: the policy itself, ratio
    1, as with num_iterations == 1), `ref_logps` (absent: no KL term; needs beta == 0)
    and `advantages`, over `completion_mask`. `frozen` is unused: the reference's
    log-probs come with the batch, computed once per rollout.

    Metrics, each a (sum, count) pair over completion tokens, so that `train.make_step`
    reports the global batch's token mean on any device count: "kl", "clip_ratio",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "is_ratio/mean" (`losses.grpo_loss`)
    and "entropy", the policy's mean per-token entropy on the completions (TRL's name).

    `vocab_chunk` (and `seq_chunk`): log-probs and entropy from the hidden states of the
    completion positions only, in chunks (`tunix_nb.vocab_chunks`); None, the default, is
    the full-logits reference. Make the rollout with the same values.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)
    chunks = vocab_chunks.chunking(vocab_chunk, seq_chunk)
    kwargs = dict(epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, kl_estimator=kl_estimator,
                  aggregation=aggregation, max_completion_length=max_completion_length)
    # fail here, not at the first step: grpo_loss's own checks, on placeholder shapes
    losses.grpo_loss(jnp.zeros((1, 1)), None, None if beta == 0 else jnp.zeros((1, 1)), jnp.zeros((1,)),
                     jnp.ones((1, 1)), **kwargs)

    def grpo_objective(params, batch, frozen=None):
        if beta != 0 and "ref_logps" not in batch:
            raise ValueError(f"beta={beta} needs the reference's log-probs in the batch (`ref_logps`): make "
                             "the rollout with the same beta (make_rollout(..., beta=beta)), or set beta=0.")
        logps_BxT, entropy_BxT = completion_log_probs(graphdef, cast_floats(params, compute_dtype), batch,
                                                      with_entropy=True, chunks=chunks)
        mask_BxT = batch["completion_mask"]
        loss_sum, weight, metrics = losses.grpo_loss(
            logps_BxT, batch.get("old_logps"), batch.get("ref_logps"),
            batch["advantages"], mask_BxT, **kwargs)
        tokens = jnp.sum(mask_BxT).astype(jnp.float32)
        # grpo_loss's token means back to sums: (mean * tokens, tokens), exact when all-reduced
        sums = {k: (v * tokens, tokens) for k, v in metrics.items()}
        sums["entropy"] = (jnp.sum(jnp.where(mask_BxT != 0, entropy_BxT, 0.0)), tokens)
        return loss_sum, weight, jax.tree.map(lax.stop_gradient, sums)

    return grpo_objective
