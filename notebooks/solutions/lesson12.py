"""Lesson 12 (your own model and data): which turns a format trains on, the shortest
--max-length a data set allows, and what the vocabulary's chunk size costs in memory.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tunix_nb import data, hf, sft, user_data
from tunix_nb.memory_plan import analysis
from tunix_nb.tokenizer import HFTokenizer

FIXTURE = data.DATA_DIR.parent / "tests" / "fixtures" / "hf" / "qwen3"


def _turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _chat(row: dict) -> list[dict]:
    return [_turn("user", row["prompt"]), _turn("assistant", row["completion"])]


def _table(rows: list[dict], columns: list[str]) -> user_data.Table:
    return user_data.Table("rows", columns, rows, [f"row {i}" for i in range(1, len(rows) + 1)])


def last_turn_only(checkpoint=FIXTURE) -> dict:
    """Lesson 12, exercise 1: the lesson's first training row (a system turn and two
    exchanges, one row of [L] tokens) as `messages` and as prompt-completion (the prompt:
    every message before the last answer). Returns the loss-token counts of both forms,
    the first answer's tokens with its end-of-turn, and whether the two rows are the same
    tokens with the prompt-completion mask inside the messages mask."""
    tok = HFTokenizer.from_dir(checkpoint)
    train = data.load_sft()
    conversation = [_turn("system", "Answer with the result only.")] + _chat(train[0]) + _chat(train[1])
    as_messages = user_data.sft_arrays(_table([{"messages": conversation}], ["messages"]), tok).arrays
    as_pc = user_data.sft_arrays(_table([{"prompt": conversation[:-1], "completion": conversation[-1:]}],
                                        ["prompt", "completion"]), tok).arrays
    inside = bool(np.all(as_pc["loss_mask"] <= as_messages["loss_mask"]))
    return {"messages_loss_tokens": int(as_messages["loss_mask"].sum()),
            "prompt_completion_loss_tokens": int(as_pc["loss_mask"].sum()),
            "first_answer_tokens": len(tok.encode(train[0]["completion"])) + 1,
            "same_tokens": bool(np.array_equal(as_messages["inputs"], as_pc["inputs"])),
            "mask_inside": inside}


def long_rows(n_short: int = 2) -> list[dict]:
    """The lesson's long.jsonl rows: two wordy questions, then `n_short` plain ones."""
    train = data.load_sft()
    wordy = [{"messages": [_turn("user", "Please work this out carefully: " + r["prompt"]),
                           _turn("assistant", r["completion"])]} for r in train[:2]]
    return wordy + [{"messages": _chat(r)} for r in train[2:2 + n_short]]


def smallest_max_length(rows: list[dict] | None = None, checkpoint=FIXTURE) -> dict:
    """Lesson 12, exercise 2: the smallest max_length at which every row of `rows` (messages,
    by default the lesson's long.jsonl) still fits, found by trying lengths upward; the
    longest row; how many rows that length cuts; and the DataError one token below it."""
    tok = HFTokenizer.from_dir(checkpoint)
    table = _table(rows or long_rows(), ["messages"])
    longest = int(user_data.sft_arrays(table, tok).arrays["attention_mask"].sum(axis=1).max()) + 1
    smallest = next(m for m in range(2, longest + 1) if _fits(table, tok, m))
    try:
        user_data.sft_arrays(table, tok, max_length=smallest - 1)
        error = None
    except data.DataError as err:
        error = str(err)
    return {"smallest": smallest, "longest_row": longest,
            "n_cut": user_data.sft_arrays(table, tok, max_length=smallest).n_cut, "error_below": error}


def _fits(table, tok, max_length: int) -> bool:
    try:
        user_data.sft_arrays(table, tok, max_length=max_length)
        return True
    except data.DataError:
        return False


def temporaries_by_chunk(vocab_size: int = 32768, chunks=(1024, 4096, 16384), batch: int = 8, length: int = 128,
                         checkpoint=FIXTURE) -> dict:
    """Lesson 12, exercise 3: XLA's temporary bytes for the SFT loss's gradient (the fixture's
    model with a `vocab_size` vocabulary, [batch, length] rows, float32), compiled for each
    vocab_chunk in `chunks` and unchunked (None); and the loss each computes on the same
    random parameters and rows."""
    _, params, config = hf.load_pretrained(checkpoint, dtype="float32")
    graphdef, abstract = hf.abstract_model(dataclasses.replace(config, vocab_size=vocab_size))
    keys = iter(jax.random.split(jax.random.key(0), 64))
    params = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), abstract)
    tokens = jax.random.randint(next(keys), (batch, length + 1), 0, vocab_size)
    rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": jnp.ones((batch, length)),
            "attention_mask": jnp.ones((batch, length), jnp.int32)}
    temp, loss = {}, {}
    for chunk in (*chunks, None):
        objective = sft.objective(graphdef, compute_dtype=jnp.float32, vocab_chunk=chunk)
        grad = jax.jit(jax.grad(lambda p, b: objective(p, b)[0]))
        temp[chunk] = analysis.temporary_bytes(grad.lower(abstract, rows).compile())
        nll, count, _ = jax.jit(objective)(params, rows)
        loss[chunk] = float(nll / count)
    return {"temp_bytes": temp, "loss": loss}
