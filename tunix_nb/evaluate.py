"""The task's own metric, for every method: greedy answers and their exact-match accuracy.

Each method's loss-based eval metrics live with the method (`sft.eval_loss`,
`dpo.eval_metrics`).
"""

from __future__ import annotations

import numpy as np

from tunix_nb import data, dpo, sft
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
