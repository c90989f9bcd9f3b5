"""The task's own metric, for every method: greedy answers and their exact-match accuracy.

Each method's loss-based eval metrics live with the method (`sft.eval_loss`,
`dpo.eval_metrics`).
"""

from __future__ import annotations

import numpy as np

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


def errors_by_position(graphdef, params, examples, *, tokenizer: Tokenizer | None = None,
                       seq_len: int = data.DEFAULT_SEQ_LEN, max_new_tokens: int = data.MAX_NEW_TOKENS,
                       prompt_len: int = data.DEFAULT_PROMPT_LEN) -> dict:
    """Token error rates by position k in the answer (answer tokens and eos), two ways.

    - "teacher_forced" [T]: the greedy token at k after the *right* answer's first k
      tokens (what training sees);
    - "free_running" [T]: token k of the model's own greedy answer (what inference sees:
      after its own first k tokens, wrong ones included);
    - "rows" [T]: how many answers have a token k;

    T is the longest answer's length.

    Where the two differ, the model's own earlier mistakes caused the errors (exposure
    bias); where its prefix is right, the two are the same prediction.
    """
    return error_rates(right_tokens_by_row(graphdef, params, examples, tokenizer=tokenizer, seq_len=seq_len,
                                           max_new_tokens=max_new_tokens, prompt_len=prompt_len))


def right_tokens_by_row(graphdef, params, examples, *, tokenizer: Tokenizer | None = None,
                        seq_len: int = data.DEFAULT_SEQ_LEN, max_new_tokens: int = data.MAX_NEW_TOKENS,
                        prompt_len: int = data.DEFAULT_PROMPT_LEN) -> dict:
    """`errors_by_position`'s counts before they are summed over rows: [N, T] bools
    "teacher_forced" and "free_running" (token k of answer n is right), "has" (answer n has
    a token k), so that any subset of the rows gives its rates (`error_rates`), and
    "own_answer" (the model's greedy answer reaches position k: its tokens and its eos;
    `errors_after_own_end`)."""
    tokenizer = tokenizer or ByteTokenizer()
    rows = data.sft_arrays(examples, tokenizer, seq_len)
    logits_NxLxV = map_in_chunks(lambda b: model_lib.apply(graphdef, params, b["inputs"], b["attention_mask"]),
                                 rows, 200)
    mask_NxL = rows["loss_mask"] > 0
    position_NxL = np.cumsum(mask_NxL, axis=1) - 1  # k of each answer token
    right_NxL = logits_NxLxV.argmax(-1) == rows["targets"]
    T = max_new_tokens
    gold_NxT = np.zeros((len(examples), T), np.int64)
    forced_NxT = np.zeros((len(examples), T), bool)
    row_M, k_M = np.nonzero(mask_NxL)[0], position_NxL[mask_NxL]  # every answer token, M in all
    gold_NxT[row_M, k_M] = rows["targets"][mask_NxL]
    forced_NxT[row_M, k_M] = right_NxL[mask_NxL]
    has_NxT = np.arange(T) < mask_NxL.sum(axis=1, keepdims=True)
    prompts = data.prompt_arrays([e["prompt"] for e in examples], tokenizer, prompt_len)
    own_NxT = map_in_chunks(lambda b: model_lib.greedy_generate(
        graphdef, params, b["tokens"], b["attention_mask"], max_new_tokens=T, eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id), prompts, 200)
    eos_NxT = own_NxT == tokenizer.eos_id
    own_end_N = np.where(eos_NxT.any(axis=1), eos_NxT.argmax(axis=1), T)  # its eos, or T if it never stops
    return {"teacher_forced": forced_NxT & has_NxT, "free_running": (own_NxT == gold_NxT) & has_NxT, "has": has_NxT,
            "own_answer": np.arange(T) <= own_end_N[:, None]}


def errors_after_own_end(right: dict, rows=slice(None)) -> dict:
    """Where the errors of `right_tokens_by_row` lie, over `rows`: token error counts
    (free-running and teacher-forced) within the model's own greedy answer (its tokens and
    its eos) and after its end.

    An answer that stops early has no token after its eos: each position there is a
    free-running error, which the right prefix (it has no eos there) mostly does not make,
    so free-running minus teacher-forced charges nearly the whole missing tail to the
    model's own prefix. The eos itself is within the answer, counted once, as any other
    wrong token."""
    has_NxT, within_NxT = right["has"][rows], right["own_answer"][rows]
    wrong = {key: ~right[key][rows] & has_NxT for key in ("free_running", "teacher_forced")}
    return {"within": {key: int((w & within_NxT).sum()) for key, w in wrong.items()},
            "after_end": {key: int((w & ~within_NxT).sum()) for key, w in wrong.items()}}


def error_rates(right: dict, rows=slice(None)) -> dict:
    """`errors_by_position`'s rates from `right_tokens_by_row`'s counts, over `rows` (a mask or
    index of the rows; all by default)."""
    has_NxT = right["has"][rows]
    count_T = has_NxT.sum(axis=0)
    longest = int(np.count_nonzero(count_T))  # positions no answer reaches have no rate
    rate = lambda right_NxT: (1 - right_NxT[rows].sum(axis=0) / np.maximum(count_T, 1))[:longest]  # noqa: E731
    return {"teacher_forced": rate(right["teacher_forced"]), "free_running": rate(right["free_running"]),
            "rows": count_T[:longest]}
