"""Supervised fine-tuning: the token-mean NLL of the completions, and its eval loss.

Tunix: `sft.peft_trainer.PeftTrainer` with its default loss. The objective returns the
NLL *summed* over completion tokens and the token count, so that `train.make_step`
all-reduces both and divides once: the global batch's token mean on any device count.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax

from tunix_nb import losses, vocab_chunks
from tunix_nb import model as model_lib
from tunix_nb.precision import cast_floats, resolve_compute_dtype


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """`python -m tunix_nb.train sft`'s own options (as TRL's SFTConfig): none beyond the shared
    ones (`train.config`) and LoRA's (`lora.LoRAConfig`)."""

    DEFAULT_LEARNING_RATE: ClassVar[float] = 3e-3
    SUMMARY: ClassVar[str] = "supervised fine-tuning on prompt/completion pairs"


def objective(graphdef, *, compute_dtype="auto", vocab_chunk=None, seq_chunk=None):
    """(params, batch, frozen) -> (NLL summed over completion tokens, token count, {}).

    `compute_dtype`: "auto" is `devices.defaults_for`'s (bfloat16 on TPU and bf16-capable GPUs, float32 on CPU), with
    float32 parameters either way; pass jnp.float32 or jnp.bfloat16 to choose.
    `vocab_chunk` (and `seq_chunk`): compute the NLL from the hidden states in chunks,
    logits only at completion positions (`tunix_nb.vocab_chunks`); None, the default,
    builds the full [B, L, V] logits, the reference path.
    A packed batch (`tunix_nb.packing`: several examples a row, with `segment_ids` and
    `positions`) gives the same sums as its examples unpacked: each attends to itself alone.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)
    chunks = vocab_chunks.chunking(vocab_chunk, seq_chunk)

    def sft_objective(params, batch, frozen=None):
        params = cast_floats(params, compute_dtype)
        segments = model_lib.segment_keywords(batch)  # {} for plain rows
        if chunks is not None:
            hidden_BxLxD = model_lib.hidden_states(graphdef, params, batch["inputs"], batch["attention_mask"],
                                                   **segments)
            nll_sum, count = vocab_chunks.sft_loss(hidden_BxLxD, model_lib.output_head(graphdef, params),
                                                   batch["targets"], batch["loss_mask"], chunks=chunks)
            return nll_sum, count, {}
        logits_BxLxV = model_lib.apply(graphdef, params, batch["inputs"], batch["attention_mask"], **segments)
        nll_sum, count = losses.sft_loss(logits_BxLxV, batch["targets"], batch["loss_mask"])
        return nll_sum, count, {}

    return sft_objective


@functools.partial(jax.jit, static_argnames="graphdef")
def _nll_sum_and_count(graphdef, params, batch):
    logits_BxLxV = model_lib.apply(graphdef, params, batch["inputs"], batch["attention_mask"])
    return losses.sft_loss(logits_BxLxV, batch["targets"], batch["loss_mask"])


def eval_loss(graphdef, params, arrays) -> float:
    """Token-mean NLL over completion tokens of a whole eval set (from `data.sft_arrays`)."""
    nll_sum, count = _nll_sum_and_count(graphdef, params, arrays)
    return float(nll_sum / count)
