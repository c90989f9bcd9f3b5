"""Evaluation: greedy answers, exact-match accuracy and token-mean eval loss."""

from __future__ import annotations

import functools

import jax
import numpy as np

from tunix_nb import data, losses
from tunix_nb import model as model_lib
from tunix_nb.tokenizer import ByteTokenizer, Tokenizer


def generate_answers(graphdef, params, prompts, *, tokenizer: Tokenizer | None = None,
                     prompt_len: int = data.DEFAULT_PROMPT_LEN, max_new_tokens: int = data.MAX_NEW_TOKENS,
                     batch_size: int = 200) -> list[str]:
    """Greedy answers to `prompts`, cut at the first eos."""
    tokenizer = tokenizer or ByteTokenizer()
    batch_size = min(batch_size, len(prompts))
    answers = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        n_real = len(chunk)
        chunk += [chunk[-1]] * (batch_size - n_real)  # pad the last chunk: one compiled shape
        batch = data.prompt_arrays(chunk, tokenizer, prompt_len)
        new_ids = np.asarray(model_lib.greedy_generate(
            graphdef, params, batch["tokens"], batch["attention_mask"], max_new_tokens=max_new_tokens,
            eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id))
        for ids in new_ids[:n_real].tolist():
            if tokenizer.eos_id in ids:
                ids = ids[: ids.index(tokenizer.eos_id)]
            answers.append(tokenizer.decode(ids))
    return answers


def exact_match_accuracy(graphdef, params, examples, **kwargs) -> float:
    """Fraction of SFT examples whose greedy answer equals the completion exactly."""
    answers = generate_answers(graphdef, params, [e["prompt"] for e in examples], **kwargs)
    return data.exact_match(answers, [e["completion"] for e in examples])


@functools.partial(jax.jit, static_argnames="graphdef")
def _nll_sum_and_count(graphdef, params, batch):
    logits = model_lib.apply(graphdef, params, batch["inputs"], batch["attention_mask"])
    return losses.sft_loss(logits, batch["targets"], batch["loss_mask"])


def eval_loss(graphdef, params, arrays) -> float:
    """Token-mean NLL over completion tokens of a whole eval set (from `data.sft_arrays`)."""
    nll_sum, count = _nll_sum_and_count(graphdef, params, arrays)
    return float(nll_sum / count)


def dpo_metrics(graphdef, params, pairs_with_ref, *, beta=0.1, loss_type="sigmoid",
                length_normalize=False) -> dict:
    """DPO loss and reward metrics of a policy on held-out pairs, under "eval/" keys.

    `pairs_with_ref` comes from `train.reference_log_probs` (cached reference values).
    """
    objective = _jitted_dpo_objective(graphdef, beta, loss_type, length_normalize)
    loss_sum, n, metrics = objective(params, pairs_with_ref)
    return {"eval/loss": float(loss_sum / n), **{f"eval/{k}": float(v) for k, v in metrics.items()}}


@functools.lru_cache(maxsize=16)
def _jitted_dpo_objective(graphdef, beta, loss_type, length_normalize):
    from tunix_nb import train  # the training objective, evaluated; train never imports this module

    return jax.jit(train.dpo_objective(graphdef, beta=beta, loss_type=loss_type,
                                       length_normalize=length_normalize))
