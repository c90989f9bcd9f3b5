"""The task's own metric, for every method: greedy answers and their exact-match accuracy.

Each method's loss-based eval metrics live with the method (`sft.eval_loss`,
`dpo.eval_metrics`).
"""

from __future__ import annotations

from tunix_nb import data
from tunix_nb.batching import map_in_chunks
from tunix_nb import model as model_lib
from tunix_nb.tokenizer import ByteTokenizer, Tokenizer


def generate_answers(graphdef, params, prompts, *, tokenizer: Tokenizer | None = None,
                     prompt_len: int = data.DEFAULT_PROMPT_LEN, max_new_tokens: int = data.MAX_NEW_TOKENS,
                     batch_size: int = 200) -> list[str]:
    """Greedy answers to `prompts`, cut at the first eos."""
    tokenizer = tokenizer or ByteTokenizer()
    prompts_BxP = data.prompt_arrays(list(prompts), tokenizer, prompt_len)

    def generate(batch):
        return model_lib.greedy_generate(graphdef, params, batch["tokens"], batch["attention_mask"],
                                         max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_id,
                                         pad_id=tokenizer.pad_id)

    answers = []
    for ids in map_in_chunks(generate, prompts_BxP, batch_size).tolist():
        if tokenizer.eos_id in ids:
            ids = ids[: ids.index(tokenizer.eos_id)]
        answers.append(tokenizer.decode(ids))
    return answers


def exact_match_accuracy(graphdef, params, examples, **kwargs) -> float:
    """Fraction of SFT examples whose greedy answer equals the completion exactly."""
    answers = generate_answers(graphdef, params, [e["prompt"] for e in examples], **kwargs)
    return data.exact_match(answers, [e["completion"] for e in examples])
