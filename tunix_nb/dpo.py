"""Direct preference optimisation: the objective, the frozen reference, and eval metrics.

Tunix: `sft.dpo.DpoTrainer`. One forward pass scores a pair's chosen and rejected
completions (stacked along the batch). The reference model never changes, so its
log-probs are computed once for every pair (`reference_log_probs`) and travel with the
batch; `cached_reference=False` runs the reference in the step instead. Either way the
reference runs in the objective's precision (`compute_dtype`), so at step 0, when
policy == reference, every margin is 0 and the sigmoid loss is ln 2.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from tunix_nb import losses, vocab_chunks
from tunix_nb.batching import map_in_chunks
from tunix_nb.config_flags import non_negative_float, option, positive_float
from tunix_nb import model as model_lib
from tunix_nb.precision import cast_floats, resolve_compute_dtype

# The batch keys of cached reference log-probs, by `length_normalize`: the key says
# which kind a value is, so an objective never reads sums as per-token means.
REFERENCE_KEYS = {False: ("ref_chosen_logps", "ref_rejected_logps"),
                  True: ("ref_chosen_logps_per_token", "ref_rejected_logps_per_token")}
_ROW_KEYS = tuple(f"{side}_{k}" for side in ("chosen", "rejected")
                  for k in ("inputs", "targets", "loss_mask", "attention_mask"))


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """`python -m tunix_nb.train dpo`'s own options (TRL's DPOConfig, Tunix's DpoTrainingConfig)."""

    DEFAULT_LEARNING_RATE: ClassVar[float] = 1e-3
    SUMMARY: ClassVar[str] = "preference pairs, from an SFT checkpoint"

    init_from: str | None = option(help="the SFT checkpoint the policy and the frozen reference start from "
                                   "(default: the SFT student shipped in data/sft_student)")
    beta: float = option(0.1, type=positive_float, help="strength of the pull towards the reference, > 0")
    loss_type: str = option("sigmoid", choices=losses.DPO_LOSS_TYPES, help="sigmoid (DPO), ipo or hinge (SLiC)")
    sft_weight: float = option(0.0, type=non_negative_float,
                               help="weight of an SFT term on the chosen answers (RPO) (default: 0)")
    length_normalize: bool = option(False, switch=True, help="compare per-token mean log-probs instead of "
                                    "sums (what IPO wants)")
    reference_in_step: bool = option(False, switch=True, help="run the frozen reference in every step instead "
                                     "of scoring it once before training (TRL's precompute_ref_log_probs=False): "
                                     "one more forward pass per step, nothing cached")


def _stacked_pair(batch):
    """Chosen rows then rejected rows, [2B, L]: one forward pass scores both."""
    return {k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
            for k in ("inputs", "targets", "loss_mask", "attention_mask")}


def _per_token(logps_B, mask_BxL):
    return logps_B / jnp.maximum(mask_BxL.sum(axis=-1), 1.0)


def _pair_sums(graphdef, params, batch, chunks=None):
    """(chosen, rejected) summed completion log-probs [B] each, from one forward pass
    (`chunks`: from hidden states in chunks, `tunix_nb.vocab_chunks`)."""
    rows = _stacked_pair(batch)
    if chunks is None:
        logits_2BxLxV = model_lib.apply(graphdef, params, rows["inputs"], rows["attention_mask"])
        logps_2B = losses.sequence_log_probs(logits_2BxLxV, rows["targets"], rows["loss_mask"])
    else:
        hidden_2BxLxD = model_lib.hidden_states(graphdef, params, rows["inputs"], rows["attention_mask"])
        logps_2B = vocab_chunks.sequence_log_probs(hidden_2BxLxD, model_lib.output_head(graphdef, params),
                                                   rows["targets"], rows["loss_mask"], chunks=chunks)
    chosen_B, rejected_B = jnp.split(logps_2B, 2)
    return chosen_B, rejected_B


def pair_log_probs(graphdef, params, batch, *, length_normalize=False, vocab_chunk=None, seq_chunk=None):
    """(chosen, rejected) completion log-probs [B] each, from one concatenated forward pass.

    `length_normalize=True` divides by the number of completion tokens (what IPO wants).
    `vocab_chunk`/`seq_chunk`: chunked log-probs (`tunix_nb.vocab_chunks`); None: full logits.
    """
    chosen_B, rejected_B = _pair_sums(graphdef, params, batch, vocab_chunks.chunking(vocab_chunk, seq_chunk))
    if length_normalize:
        return _per_token(chosen_B, batch["chosen_loss_mask"]), _per_token(rejected_B, batch["rejected_loss_mask"])
    return chosen_B, rejected_B


def reference_log_probs(graphdef, params, pair_arrays, *, length_normalize=False, batch_size=256,
                        compute_dtype="auto", vocab_chunk=None, seq_chunk=None):
    """The frozen reference model's log-probs for every pair, computed once.

    Returns `pair_arrays` plus two [N] arrays, so that `data.batch_at` hands each DPO
    step its pairs' cached reference values: `ref_chosen_logps`/`ref_rejected_logps`
    (sums), or with `length_normalize=True` `ref_chosen_logps_per_token`/
    `ref_rejected_logps_per_token` (`REFERENCE_KEYS`). Call it once per kind to carry
    both. Pass the objective's `compute_dtype`: the reference must run in the policy's
    precision, or policy and reference differ at step 0. `vocab_chunk`/`seq_chunk` as in `objective`.
    """
    fn = _jitted_reference(graphdef, length_normalize, resolve_compute_dtype(compute_dtype),
                           vocab_chunks.chunking(vocab_chunk, seq_chunk))
    rows = {k: pair_arrays[k] for k in _ROW_KEYS}
    chosen, rejected = map_in_chunks(lambda chunk: fn(params, chunk), rows, batch_size)
    chosen_key, rejected_key = REFERENCE_KEYS[length_normalize]
    return {**pair_arrays, chosen_key: chosen, rejected_key: rejected}


@functools.lru_cache(maxsize=16)
def _jitted_reference(graphdef, length_normalize, compute_dtype, chunks=None):
    """One compiled scorer per (model, kind, precision, chunking): repeated calls do not recompile."""
    chunk_kwargs = {} if chunks is None else {"vocab_chunk": chunks.vocab_chunk, "seq_chunk": chunks.seq_chunk}
    return jax.jit(lambda p, b: pair_log_probs(graphdef, cast_floats(p, compute_dtype), b,
                                               length_normalize=length_normalize, **chunk_kwargs))


def _cached_reference(batch, length_normalize):
    """The batch's cached reference log-probs of the kind the objective uses; checked at trace time."""
    keys = REFERENCE_KEYS[length_normalize]
    if all(k in batch for k in keys):
        return batch[keys[0]], batch[keys[1]]
    kind = {False: "summed", True: "per-token"}
    if all(k in batch for k in REFERENCE_KEYS[not length_normalize]):
        raise ValueError(
            f"The batch carries {kind[not length_normalize]} reference log-probs but the objective was built "
            f"with length_normalize={length_normalize} and compares {kind[length_normalize]} ones: compute "
            f"them with reference_log_probs(..., length_normalize={length_normalize}) (call it once per kind "
            "to carry both), or build the objective with the length_normalize the reference was computed with.")
    raise ValueError(
        f"The batch has no cached reference log-probs ({keys[0]}, {keys[1]}): add them with "
        f"reference_log_probs(..., length_normalize={length_normalize}), or build the objective with "
        "cached_reference=False and pass the reference parameters as the step's `frozen`.")


def objective(graphdef, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
              length_normalize=False, cached_reference=True, sft_weight=0.0, compute_dtype="auto",
              vocab_chunk=None, seq_chunk=None):
    """(policy params, batch, reference params or None) -> (loss sum, pairs B, metrics).

    With `cached_reference` the batch carries the reference log-probs of the objective's
    kind (`reference_log_probs` with the same `length_normalize` and `compute_dtype`;
    the other kind raises a ValueError); otherwise the frozen reference model runs in
    the step. The loss sum over B is the mean pair loss.

    `sft_weight > 0` adds that multiple of the chosen answers' NLL (RPO), as TRL's
    `rpo_alpha` (since TRL's DPO refactor, the weighted loss_type "sft"): the NLL summed
    over all chosen completion tokens of the batch, divided by their number (a token
    mean, whatever `length_normalize`). It keeps the chosen
    answers likely while the margin grows. The objective then returns two named terms,
    "dpo" (pair losses over pairs) and "sft" (sft_weight times the chosen tokens' NLL over
    their count), and `train.make_step` all-reduces each sum and count before dividing:
    the global batch's token mean on any number of devices (TRL on several GPUs averages
    per-device token means instead). The step reports them as "loss/dpo" and "loss/sft".

    `vocab_chunk` (and `seq_chunk`): the log-probs from hidden states in chunks, logits
    only at completion positions (`tunix_nb.vocab_chunks`); None, the default, builds the
    full [2B, L, V] logits, the reference path. Compute a cached reference the same way.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)
    chunks = vocab_chunks.chunking(vocab_chunk, seq_chunk)
    if loss_type not in losses.DPO_LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}; choose one of {losses.DPO_LOSS_TYPES}.")

    def reference(batch, reference_params):
        if cached_reference:
            return _cached_reference(batch, length_normalize)
        if reference_params is None:
            raise ValueError("cached_reference=False runs the reference model in the step: pass its parameters "
                             "as the step's `frozen` (train.run(..., frozen=reference_params)).")
        return lax.stop_gradient(pair_log_probs(graphdef, cast_floats(reference_params, compute_dtype), batch,
                                                length_normalize=length_normalize, vocab_chunk=vocab_chunk,
                                                seq_chunk=seq_chunk))

    def dpo_objective(params, batch, reference_params=None):
        ref_c, ref_r = reference(batch, reference_params)
        sum_c, sum_r = _pair_sums(graphdef, cast_floats(params, compute_dtype), batch, chunks)
        pi_c, pi_r = sum_c, sum_r
        if length_normalize:
            pi_c, pi_r = _per_token(sum_c, batch["chosen_loss_mask"]), _per_token(sum_r, batch["rejected_loss_mask"])
        loss, metrics = losses.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=beta, loss_type=loss_type,
                                        label_smoothing=label_smoothing)
        n = pi_c.shape[0]
        loss_sum = loss * n
        metrics = {**metrics, "logps/chosen": pi_c.mean(), "logps/rejected": pi_r.mean()}
        metrics = jax.tree.map(lax.stop_gradient, metrics)
        if not sft_weight:
            return loss_sum, jnp.float32(n), metrics
        # RPO: a second term, the NLL over the chosen tokens, normalised by their count
        tokens = batch["chosen_loss_mask"].sum().astype(jnp.float32)
        return ({"dpo": loss_sum, "sft": -sft_weight * sum_c.sum()}, {"dpo": jnp.float32(n), "sft": tokens},
                metrics)

    return dpo_objective


def eval_metrics(graphdef, params, pairs_with_ref, *, beta=0.1, loss_type="sigmoid",
                 length_normalize=False, compute_dtype="auto") -> dict:
    """DPO loss and reward metrics of a policy on held-out pairs, under "eval/" keys.

    `pairs_with_ref` comes from `reference_log_probs` with the same `length_normalize`
    and `compute_dtype` (cached reference values).
    """
    fn = _jitted_objective(graphdef, beta, loss_type, length_normalize, resolve_compute_dtype(compute_dtype))
    loss_sum, n, metrics = fn(params, pairs_with_ref)
    return {"eval/loss": float(loss_sum / n), **{f"eval/{k}": float(v) for k, v in metrics.items()}}


@functools.lru_cache(maxsize=16)
def _jitted_objective(graphdef, beta, loss_type, length_normalize, compute_dtype):
    return jax.jit(objective(graphdef, beta=beta, loss_type=loss_type, length_normalize=length_normalize,
                             compute_dtype=compute_dtype))
