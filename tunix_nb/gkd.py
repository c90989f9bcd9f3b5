"""On-policy distillation (GKD): the student learns from the teacher on its own samples.

Generalized Knowledge Distillation (Agarwal et al., 2024; TRL's `GKDTrainer`). Offline
distillation (`tunix_nb.distill`, lesson 02) trains on the dataset's answers: the
student only ever sees correct prefixes, while at inference it continues its own, and
its mistakes compound where the teacher never showed it what to do (exposure bias).
GKD mixes in sequences the student samples itself, scored token by token by the
teacher. Tunix's `DistillationTrainer` is offline only; this goes past it.

Each step's batch comes from one source, a pure function of (seed, step)
(`batch_source`):
- "student", with probability `lmbda`: the student samples a completion of each of the
  step's prompts with its current params (`temperature`; row r of step s with
  `sampler.rollout_keys`), and the teacher scores it inside the step. Its own tokens are
  no right answer, so these rows (`own_sample` = 1) train on the divergence alone.
- "teacher", otherwise, with `seq_kd`: the teacher's greedy completions of the prompts
  (sequence-level KD, Kim & Rush 2016), generated in the step, as TRL does (TRL samples
  them at its temperature; greedy is the paper's sequence-level KD).
- "data", otherwise: the dataset's answers, i.e. offline distillation.

The loss is `distill.objective` with `beta` (0 forward KL, 1 reverse KL, between: the
generalized JSD), on the completion tokens, per example under `vmap`. With lmbda = 0,
beta = 0 and no seq_kd every batch is "data" and the step is lesson 02's, bit for bit.

What is data-parallel: sampling, the student's and the teacher's (each device samples its
own rows, `sampler.make_sampler`, with one key per row, so 1 device and 8 draw the same
tokens), and the step (sums and counts all-reduced, as for every method). `make_batches`
returns a `rollout_fn` for `train.run_on_policy`, with the teacher as its `frozen` argument.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from tunix_nb import data, sampler
from tunix_nb.config_flags import in_unit_interval, option, positive_float, positive_int
from tunix_nb.tokenizer import ByteTokenizer, Tokenizer

DEFAULT_TEMPERATURE, DEFAULT_MAX_NEW_TOKENS = 1.0, 8  # as grpo.GRPOConfig's


_share = in_unit_interval("is a share of steps, in [0, 1]")


@dataclasses.dataclass(frozen=True)
class GKDConfig:
    """On-policy distillation's options (`distill --lmbda ...`; TRL's GKDConfig). All None is offline
    distillation, recorded as before GKD existed; `resolved` fills in what a sampling run uses."""

    TITLE = "on-policy distillation (GKD, as TRL's GKDTrainer)"
    DESCRIPTION = ("batches whose completions the student samples itself (--temperature, --max-new-tokens), "
                   "scored by the teacher with --beta's divergence")

    lmbda: float | None = option(type=_share, help="share of steps whose batch the student samples, in [0, 1] "
                                 "(default: 0, offline)")
    seq_kd: bool | None = option(None, switch=True, help="the other steps train on the teacher's greedy answers "
                                 "instead of the dataset's")
    temperature: float | None = option(type=positive_float, help=f"sampling temperature, > 0 (default: "
                                       f"{DEFAULT_TEMPERATURE}; needs --lmbda > 0)")
    max_new_tokens: int | None = option(type=positive_int, help=f"tokens sampled per completion (default: "
                                        f"{DEFAULT_MAX_NEW_TOKENS}; needs --lmbda > 0 or --seq-kd)")

    def resolved(self, beta: float | None) -> tuple["GKDConfig", float | None]:
        """(this config, distill's beta) with defaults filled in: all None when nothing is sampled
        and beta is 0 (offline distillation, as before), else numbers. Raises ValueError naming
        a sampling flag given where nothing samples."""
        lmbda, seq_kd = self.lmbda or 0.0, bool(self.seq_kd)
        if self.temperature is not None and lmbda == 0:
            raise ValueError("--temperature samples the student's batches: it needs --lmbda > 0")
        if self.max_new_tokens is not None and lmbda == 0 and not seq_kd:
            raise ValueError("--max-new-tokens needs --lmbda > 0 or --seq-kd: offline distillation samples nothing")
        if lmbda == 0 and not seq_kd and not beta:
            return GKDConfig(), None
        return GKDConfig(
            lmbda=float(lmbda), seq_kd=seq_kd,
            temperature=(self.temperature or DEFAULT_TEMPERATURE) if lmbda > 0 else None,
            max_new_tokens=(self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS) if lmbda > 0 or seq_kd else None,
        ), float(beta or 0.0)


_COIN = 0x6B64  # the coin's own stream: it never shares draws with the data order or sampling


def check_settings(lmbda: float, beta: float = 0.0) -> None:
    """Raise a ValueError naming the fix for an lmbda or beta outside [0, 1]."""
    if not 0.0 <= lmbda <= 1.0:  # also refuses NaN
        raise ValueError(f"lmbda is the share of batches the student samples itself, in [0, 1]; got {lmbda}.")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta interpolates the divergence (0 forward KL, 1 reverse KL), in [0, 1]; got {beta}.")


def batch_source(seed: int, step: int, lmbda: float, seq_kd: bool) -> str:
    """Where step `step`'s completions come from: "student" with probability lmbda, else
    "teacher" (seq_kd) or "data". A pure function of (seed, step): a resumed run, or one
    on another device count, makes the same choice."""
    if lmbda > 0 and np.random.default_rng([seed, step, _COIN]).random() < lmbda:
        return "student"
    return "teacher" if seq_kd else "data"


def sampled_batch(rows: dict, *, own_sample: bool) -> dict:
    """Sampled completions (`sampler.training_rows`' prompt + completion rows) as a distillation
    batch: `loss_mask` is 0 on the prompt and the completion mask on the completion, and
    `own_sample` [B] says whether the student sampled the row itself."""
    completion_mask_BxT = np.asarray(rows["completion_mask"], np.int32)
    B, S = np.shape(rows["inputs"])
    prompt_BxS = np.zeros((B, S - completion_mask_BxT.shape[1]), np.int32)
    return {"inputs": np.asarray(rows["inputs"]), "targets": np.asarray(rows["targets"]),
            "attention_mask": np.asarray(rows["attention_mask"]),
            "loss_mask": np.concatenate([prompt_BxS, completion_mask_BxT], axis=1),
            "own_sample": np.full((B,), float(own_sample), np.float32)}


def make_batches(student_graphdef, teacher_graphdef, examples: Sequence[dict], *, batch_size: int, seed: int,
                 lmbda: float, seq_kd: bool = False, temperature: float = 1.0,
                 max_new_tokens: int = data.MAX_NEW_TOKENS, compute_dtype="auto", parallel_mode: str = "jit",
                 mesh=None, tokenizer: Tokenizer | None = None, seq_len: int = data.DEFAULT_SEQ_LEN,
                 prompt_len: int = data.DEFAULT_PROMPT_LEN) -> Callable:
    """`rollout_fn(step, params, reference, teacher) -> (batch, metrics)` for `train.run_on_policy`
    (pass the teacher as its `frozen`; `reference` is unused).

    Step s uses the examples `data.batch_at(seed=seed)` picks (the same as offline
    distillation) and the source `batch_source` picks. Both samplers run data-parallel
    with the step's `parallel_mode` and `mesh` (see `sampler.make_sampler`), on the params
    as the step holds them. Metrics: "gkd/on_policy" (1 when the student sampled the
    batch) and, for sampled batches, "completions/mean_length" (tokens, eos included).
    """
    if lmbda == 0 and not seq_kd:
        raise ValueError("lmbda=0 without seq_kd is offline distillation: train on the rows with train.run, "
                         "or set lmbda > 0 (or seq_kd=True) for on-policy batches.")
    check_settings(lmbda)
    tokenizer = tokenizer or ByteTokenizer()
    rows = data.sft_arrays(examples, tokenizer, seq_len)
    prompts = sampler.prompt_rows(examples, tokenizer, prompt_len)
    common = dict(max_new_tokens=max_new_tokens, compute_dtype=compute_dtype, eos_id=tokenizer.eos_id,
                  pad_id=tokenizer.pad_id, parallel_mode=parallel_mode, mesh=mesh)
    sample = {"student": sampler.make_sampler(student_graphdef, temperature=temperature, **common),
              "teacher": sampler.make_sampler(teacher_graphdef, temperature=0.0, **common)}  # greedy: seq_kd

    def rollout_fn(step, params, reference=None, teacher=None):
        source = batch_source(seed, step, lmbda, seq_kd)
        if source == "data":
            return data.batch_at(rows, step, batch_size, seed=seed), {"gkd/on_policy": 0.0}
        picked = data.batch_at(prompts, step, batch_size, seed=seed)
        out = sample[source](params if source == "student" else teacher, None, picked["prompt_tokens"],
                             picked["prompt_mask"], sampler.rollout_keys(seed, step, batch_size))
        batch = sampled_batch(out, own_sample=source == "student")
        lengths = batch["loss_mask"].sum(axis=1)
        return batch, {"gkd/on_policy": float(source == "student"), "completions/mean_length": float(lengths.mean())}

    return rollout_fn
