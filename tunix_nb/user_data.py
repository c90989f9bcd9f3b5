"""Your own data in TRL's dataset formats -> the kit's training arrays.

A data source is a local `.jsonl`, `.json` or `.parquet` file, or (online) a Hugging Face
Hub dataset id; Hugging Face `datasets` reads it. Its columns say which of TRL's formats
it is (https://huggingface.co/docs/trl/dataset_formats); each method accepts these:

    method  format               columns                        loss on
    sft     prompt_completion    prompt, completion             the completion and its eos
            messages             messages                       every assistant turn and its end-of-turn
            language_modeling    text                           every token (and the eos)
    dpo     preference           prompt, chosen, rejected       chosen / rejected and their eos
            implicit_preference  chosen, rejected               (the prompt is their common start)
    grpo    prompt_only          prompt (+ any other columns,   (no loss: prompts to sample from; the
                                 kept for the reward functions)  other columns go to the rewards)

`prompt`, `completion`, `chosen` and `rejected` are either all strings ("standard") or all
lists of {"role", "content"} messages ("conversational"). Standard rows are encoded as the
shipped task's are (`tunix_nb.data`): `[bos] + prompt + completion + [eos]`. Conversational
rows go through the tokenizer's chat template, once, and the kit adds nothing: a template
that writes its own bos (Llama 3) gets exactly one, and the ids are transformers'
`apply_chat_template` ids. The loss mask covers the completion's (or assistant turn's)
tokens up to and including the last eos the template writes there (its end-of-turn); what
the template writes after it (ChatML's newline) is in the row but gets no loss. The spans
come from rendering prefixes of the conversation, as TRL finds its prompt and assistant
tokens: the prompt with `add_generation_prompt=True` must render as the start of the whole.
`template_kwargs` reach the template (transformers' `apply_chat_template(**kwargs)`): with
Qwen3's, `enable_thinking=False` puts the empty `<think>` block into the generation prompt,
so it is prompt; left on, the block the template writes into the last reply gets loss.

Truncation (`max_length`: most tokens in a row, as TRL's `max_length`): a prompt that does
not fit loses its BEGINNING (a leading bos is kept), so the end of the prompt, next to the
answer, stays; the completion is never cut, nor the assistant header before it. For
`messages`, the last assistant turn is the completion and everything before it is the
prompt (earlier assistant tokens that survive keep their loss). `text` rows have no prompt:
they lose their end, eos included (TRL's `keep_start`). A row that cannot fit even with
its whole prompt cut is an error naming the row, its length and the `max_length` it needs.
For GRPO, `max_length` bounds the prompt alone (TRL's `max_prompt_length`).

Arrays are padded to the longest row kept (not to `max_length`), with the keys, dtypes and
padding sides of `data.sft_arrays`, `data.preference_arrays` and `sampler.prompt_rows`, so
`data.batch_at(arrays, step, batch_size, seed=seed)` batches them as it does the shipped
task: a pure function of (seed, step).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from tunix_nb.data import DataError
from tunix_nb.tokenizer import Tokenizer

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# data files `datasets` could read but the kit does not take: a clear error, not a Hub lookup
OTHER_SUFFIXES = {".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip", ".xlsx"}

# format -> the columns that name it, per method (checked in this order)
FORMATS = {
    "sft": {"messages": ("messages",), "prompt_completion": ("prompt", "completion"),
            "language_modeling": ("text",)},
    "dpo": {"preference": ("prompt", "chosen", "rejected"), "implicit_preference": ("chosen", "rejected")},
    "grpo": {"prompt_only": ("prompt",)},
}


class Table(NamedTuple):
    """A data source as read: `rows` (dicts of Python values), `columns`, and for each
    row the label errors name it by (`"my.jsonl line 3"`, `"my.parquet row 3"`)."""

    source: str
    columns: list[str]
    rows: list[dict]
    labels: list[str]


class Encoded(NamedTuple):
    """What the encoders return: the arrays a method consumes, the format found, how many
    rows truncation cut, and (GRPO) the rows as read, for the reward functions."""

    arrays: dict[str, np.ndarray]
    format: str
    conversational: bool
    n_cut: int
    examples: list[dict] | None = None


class Row(NamedTuple):
    """One token row: `ids`, `loss` (a flag per token: a target with loss), and the
    prompt span [cut_from, cut_to) that truncation may drop from its start."""

    ids: list[int]
    loss: list[bool]
    cut_from: int
    cut_to: int


# ---------------------------------------------------------------- reading


def read_table(source: str | os.PathLike, *, split: str = "train", revision: str | None = None) -> Table:
    """Read a local .jsonl/.json/.parquet file, or a Hub dataset id (online), with `datasets`."""
    import datasets  # imported here: the shipped task never needs it

    datasets.disable_progress_bars()  # a bar per tiny file would bury the training log
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix in SUFFIXES or suffix in OTHER_SUFFIXES or path.exists():
        if suffix not in SUFFIXES:
            raise DataError(f"{source}: unsupported file type; pass a .jsonl, .json or .parquet file "
                            "(TRL's formats), or a Hugging Face Hub dataset id.")
        if not path.is_file():
            raise DataError(f"{source}: file not found; check the path.")
        _check_text(path)
        try:
            ds = datasets.load_dataset(SUFFIXES[suffix], data_files=str(path), split="train")
        except Exception as err:  # pyarrow's messages name neither line nor field: find them
            _diagnose_json(path)
            raise DataError(f"{source}: `datasets` could not read it ({type(err).__name__}: {err}).") from None
        return Table(str(source), list(ds.column_names), _plain_rows(ds), _labels(path, len(ds)))
    if datasets.config.HF_HUB_OFFLINE:
        raise DataError(f"{source}: not a local file, and the Hugging Face Hub is offline (HF_HUB_OFFLINE=1); "
                        "pass a local .jsonl, .json or .parquet file, or go online to read a Hub dataset id.")
    try:
        ds = datasets.load_dataset(str(source), split=split, revision=revision)
    except Exception as err:
        raise DataError(f"{source}: not a local file, and `datasets` could not load it from the Hugging Face "
                        f"Hub ({type(err).__name__}: {err}). Check the id and that you are online (not "
                        "HF_HUB_OFFLINE=1), or pass a local .jsonl, .json or .parquet file.") from None
    return Table(str(source), list(ds.column_names), _plain_rows(ds), [f"{source} row {i}" for i in
                                                                       range(1, len(ds) + 1)])


def _check_text(path: Path) -> None:
    """A DataError for an empty file, or (JSON, JSON Lines) one that is not UTF-8 text, naming
    the line and column: `datasets` would say only "StopIteration" or a codec error without either.
    Read a line at a time, so a large file is not held in memory twice."""
    text = path.suffix.lower() != ".parquet"
    empty = True
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            empty = empty and not line.strip()
            if not text:
                if not empty:
                    return
                continue
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path} line {n}: byte 0x{line[err.start]:02x} at column {err.start + 1} is not "
                                "UTF-8; save the file as UTF-8.") from None
    if empty:
        raise DataError(f"{path}: the file is empty; give it the examples (one JSON object per line for .jsonl).")


def _plain_rows(ds) -> list[dict]:
    """Rows as dicts; messages lose the keys Arrow filled with None (a message without
    `tool_calls` in a file where another has them), so templates see them undefined."""
    def clean(value):
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if v is not None}
        return value
    return [{k: (clean(v) if isinstance(v, list) else v) for k, v in row.items()} for row in ds]


def _labels(path: Path, n_rows: int) -> list[str]:
    """'file line N' (1-based lines, blank lines skipped as the reader skips them) for JSONL,
    'file row N' otherwise."""
    if path.suffix.lower() == ".jsonl":
        with open(path, "rb") as f:
            lines = [n for n, line in enumerate(f, start=1) if line.strip()]
        if len(lines) == n_rows:
            return [f"{path} line {n}" for n in lines]
    return [f"{path} row {i}" for i in range(1, n_rows + 1)]


def _diagnose_json(path: Path) -> None:
    """For a JSON Lines file `datasets` rejected, raise a DataError naming the line (and the
    field) at fault: a line that is not a JSON object, or a field whose type differs from
    the first line that has it. Returns if it finds nothing (the caller then raises)."""
    if path.suffix.lower() != ".jsonl":
        return
    kinds: dict[str, tuple[str, int]] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise DataError(f"{path} line {n}: not valid JSON ({err}); each line must be one JSON object.") \
                    from None
            if not isinstance(obj, dict):
                raise DataError(f"{path} line {n}: expected a JSON object {{...}}, got {type(obj).__name__}.")
            for key, value in obj.items():
                kind = type(value).__name__
                first = kinds.setdefault(key, (kind, n))
                if value is not None and first[0] != kind and first[0] != "NoneType":
                    raise DataError(f"{path} line {n}: field {key!r} is a {kind}, but a {first[0]} on line "
                                    f"{first[1]}; give every row the same type ({_EXPECTED.get(key, 'one type')}).")


_PAIRED = ("completion", "chosen", "rejected")
_EXPECTED = {k: "a string, or a list of {'role', 'content'} messages"
             for k in ("prompt", "completion", "chosen", "rejected")}
_EXPECTED.update(text="a string", messages="a list of {'role', 'content'} messages")


# ---------------------------------------------------------------- formats and fields


def detect_format(table: Table, method: str) -> str:
    """The format of `table` for `method` ('sft', 'dpo', 'grpo'), from its columns."""
    if method not in FORMATS:
        raise DataError(f"method must be one of {sorted(FORMATS)}, got {method!r}.")
    formats = FORMATS[method]
    found = [name for name, cols in formats.items() if set(cols) <= set(table.columns)]
    if method == "sft" and len(found) > 1:
        raise DataError(f"{table.source}: columns {table.columns} fit several SFT formats ({', '.join(found)}); "
                        "keep the columns of one: 'messages', or 'prompt' and 'completion', or 'text'.")
    if not found:
        accepted = "; ".join(f"{name}: {', '.join(cols)}" for name, cols in formats.items())
        raise DataError(f"{table.source}: columns {table.columns} fit no {method} format; "
                        f"{method} accepts ({accepted}).")
    return found[0]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_field(label: str, row: dict, field: str, conversational: bool | None) -> bool:
    """Check row[field] (a non-empty string or message list); returns whether it is a message list."""
    value = row.get(field)
    want = {None: _EXPECTED[field], True: "a list of {'role', 'content'} messages",
            False: "a string"}[conversational]
    if value is None:
        raise DataError(f"{label}: field {field!r} is missing or null; it must be {want}.")
    if not isinstance(value, (str, list)) or (conversational is not None and isinstance(value, list) != conversational):
        # prompt/completion/chosen/rejected: all strings or all messages, decided by the row's first field
        same = ", as the row's other fields are" if conversational is not None and field in _PAIRED else ""
        raise DataError(f"{label}: field {field!r} is {type(value).__name__} {_short(value)}; it must be {want}{same}.")
    if isinstance(value, str) and not value.strip():
        raise DataError(f"{label}: field {field!r} is empty or only whitespace; give it some text or drop the row.")
    if isinstance(value, list):
        _check_messages(label, field, value)
    return isinstance(value, list)


# The roles chat templates know (OpenAI's and TRL's); any other would reach the template unchecked.
ROLES = ("system", "user", "assistant", "tool")


def _check_messages(label: str, field: str, messages: list) -> None:
    if not messages:
        raise DataError(f"{label}: field {field!r} is an empty list of messages.")
    for i, m in enumerate(messages, start=1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{label}: field {field!r} message {i} must be {{'role': str, 'content': str}}, "
                            f"got {_short(m)}.")
        if m["role"] not in ROLES:
            raise DataError(f"{label}: field {field!r} message {i} has role {m['role']!r}; roles are "
                            f"{', '.join(map(repr, ROLES))}. Map the others before training (ShareGPT's "
                            "'human' is 'user', 'gpt' is 'assistant'): the loss falls on 'assistant' turns only.")
        if m["role"] == "assistant" and not m["content"].strip():
            raise DataError(f"{label}: field {field!r} message {i} is an empty assistant turn; give it content.")


def _check_row(label: str, row: dict, fields: Sequence[str]) -> bool:
    """Check every field of one row; all must be strings or all message lists. Returns which."""
    conversational = _check_field(label, row, fields[0], None)
    for field in fields[1:]:
        _check_field(label, row, field, conversational)
    return conversational


def _needs_template(tokenizer: Tokenizer, label: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{label}: conversational rows need a chat template, and this tokenizer "
                        f"({type(tokenizer).__name__}) has none. Use a checkpoint whose tokenizer has one "
                        "(tokenizer_config.json's chat_template, or chat_template.jinja), or write the rows as "
                        "plain strings ('prompt'/'completion', or 'text').")


# ---------------------------------------------------------------- token rows


def _render(tokenizer, label: str, messages: list, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    except Exception as err:  # jinja's raise_exception, or a template that reads a missing key
        raise DataError(f"{label}: the chat template rejected the conversation ({err}).") from None


def _boundary(tokenizer, label: str, text: str, ids: list[int], prefix_text: str) -> int:
    """How many of `ids` (the tokens of `text`) the rendered prefix is: it must render as the
    start of `text` and tokenize as the start of `ids`."""
    prefix_ids = tokenizer.encode(prefix_text)
    if not text.startswith(prefix_text) or ids[:len(prefix_ids)] != prefix_ids:
        raise DataError(f"{label}: the chat template renders the start of this conversation differently from "
                        "(or splits a token across) the start of the whole (a template that rewrites earlier "
                        "turns, or a token spanning a turn boundary), so the kit cannot find which tokens are "
                        "the assistant's. Qwen3's template does this to a row with several assistant turns (it "
                        "writes a <think> block only into turns after the last user message): make one row per "
                        "assistant turn, as prompt (the turns before it) and completion (that turn); and to a "
                        "turn with reasoning under enable_thinking false, whose prompt ends in an empty <think> "
                        "block: drop the reasoning or the setting.")
    return len(prefix_ids)


def _span_loss(ids: list[int], start: int, end: int, eos_id: int) -> list[int]:
    """Positions with loss in [start, end): up to and including the span's last eos (its
    end-of-turn); the whole span if the template writes no eos there."""
    eos_at = [i for i in range(start, end) if ids[i] == eos_id]
    return list(range(start, eos_at[-1] + 1 if eos_at else end))


def _chat_row(tokenizer, label: str, full: list, turns: list[tuple[int, int]]) -> Row:
    """A conversation's row. `turns`: (start, end) message indices of `full` with loss (start
    > 0); the last one is the completion and the messages before it are the prompt."""
    _needs_template(tokenizer, label)
    text = _render(tokenizer, label, full, False)
    ids = tokenizer.encode(text)

    def at(n_messages: int, generation_prompt: bool) -> int:  # where the first n messages end
        prefix = _render(tokenizer, label, full[:n_messages], generation_prompt)
        return _boundary(tokenizer, label, text, ids, prefix)

    loss = [False] * len(ids)
    for start, end in turns:
        for i in _span_loss(ids, at(start, True), at(end, False), tokenizer.eos_id):
            loss[i] = True
    head = 1 if ids and ids[0] == tokenizer.bos_id else 0
    return Row(ids, loss, head, max(head, at(turns[-1][0], False)))


def _plain_row(tokenizer, prompt: str, completion: str) -> Row:
    """`[bos] + prompt + completion + [eos]`, loss on completion + eos (as `data.sft_arrays`)."""
    p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
    ids = [tokenizer.bos_id, *p, *c, tokenizer.eos_id]
    return Row(ids, [False] * (1 + len(p)) + [True] * (len(c) + 1), 1, 1 + len(p))


def _text_row(tokenizer, text: str) -> Row:
    """`[bos] + text + [eos]`, loss on every token after bos; nothing is a prompt."""
    ids = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
    return Row(ids, [False] + [True] * (len(ids) - 1), 1, 1)


def _messages_turns(label: str, messages: list) -> list[tuple[int, int]]:
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{label}: field 'messages' ends with a {messages[-1]['role']!r} turn; a conversation to "
                        "train on must end with the assistant's turn (drop the trailing turns).")
    if messages[0]["role"] == "assistant":
        raise DataError(f"{label}: field 'messages' starts with the assistant's turn; start it with the "
                        "user's (or the system's) turn the answer responds to.")
    return [(i, i + 1) for i, m in enumerate(messages) if m["role"] == "assistant"]


def _prompt_completion_row(tokenizer, label: str, prompt, completion) -> Row:
    if isinstance(prompt, str):
        return _plain_row(tokenizer, prompt, completion)
    return _chat_row(tokenizer, label, prompt + completion, [(len(prompt), len(prompt) + len(completion))])


def _sft_row(tokenizer, label: str, row: dict, fmt: str) -> Row:
    if fmt == "language_modeling":
        _check_field(label, row, "text", False)
        return _text_row(tokenizer, row["text"])
    if fmt == "messages":
        _check_field(label, row, "messages", True)
        messages = row["messages"]
        turns = _messages_turns(label, messages)
        return _chat_row(tokenizer, label, messages, turns)
    _check_row(label, row, ("prompt", "completion"))
    return _prompt_completion_row(tokenizer, label, row["prompt"], row["completion"])


# ---------------------------------------------------------------- truncation


def _too_long(label: str, what: str, need: int, max_length: int) -> DataError:
    return DataError(f"{label}: {what} needs {need} tokens even with its whole prompt cut (the completion is "
                     f"never cut), but max_length={max_length}; raise max_length to at least {need}, or shorten "
                     "or drop the row.")


def cut_prompt(row: Row, n: int) -> Row:
    """`row` without the first `n` tokens of its prompt span (n <= the span's length)."""
    keep = list(range(row.cut_from)) + list(range(row.cut_from + n, len(row.ids)))
    return Row([row.ids[i] for i in keep], [row.loss[i] for i in keep], row.cut_from, row.cut_to - n)


def _fit(label: str, what: str, row: Row, max_length: int | None, keep_start: bool = False) -> tuple[Row, bool]:
    """`row` cut to `max_length` tokens by the policy; (row, whether it was cut)."""
    if max_length is None or len(row.ids) <= max_length:
        return row, False
    if keep_start:  # `text`: no prompt; keep the start, lose the end (and the eos)
        return Row(row.ids[:max_length], row.loss[:max_length], row.cut_from, row.cut_to), True
    excess, room = len(row.ids) - max_length, row.cut_to - row.cut_from
    if excess > room:
        raise _too_long(label, what, len(row.ids) - room, max_length)
    return cut_prompt(row, excess), True


def _rendering(tokenizer, template_kwargs: dict | None):
    """`tokenizer`, passing `template_kwargs` to every chat-template rendering (Qwen3's enable_thinking)."""
    if not template_kwargs:
        return tokenizer
    if not hasattr(tokenizer, "with_template_kwargs"):
        raise DataError(f"chat template kwargs {json.dumps(template_kwargs)} given, but the "
                        f"{type(tokenizer).__name__} has no chat template to pass them to; drop them.")
    try:
        return tokenizer.with_template_kwargs(template_kwargs)
    except ValueError as err:
        raise DataError(str(err)) from None


def _check_max_length(max_length: int | None) -> None:
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length < 2):
        raise DataError(f"max_length must be an int >= 2 (tokens in a row) or None, got {max_length!r}.")


# ---------------------------------------------------------------- arrays


def _stack_rows(rows: Sequence[Row], pad_id: int, seq_len: int) -> dict[str, np.ndarray]:
    """`inputs_NxL`, `targets_NxL` (int32), `loss_mask_NxL` (float32), `attention_mask_NxL` (int32),
    right-padded, exactly as `data.sft_arrays` lays out a row (L = seq_len)."""
    n = len(rows)
    tokens = np.full((n, seq_len + 1), pad_id, dtype=np.int32)
    loss = np.zeros((n, seq_len + 1), dtype=np.float32)
    lengths = np.array([len(r.ids) for r in rows])
    for i, r in enumerate(rows):
        tokens[i, :len(r.ids)] = r.ids
        loss[i, :len(r.ids)] = r.loss
    t = np.arange(seq_len)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": loss[:, 1:],
            "attention_mask": (t[None, :] < lengths[:, None]).astype(np.int32)}


def _seq_len(rows: Sequence[Row], seq_len: int | None) -> int:
    longest = max(len(r.ids) for r in rows)
    if seq_len is None:
        return longest - 1
    if seq_len < longest - 1:
        raise DataError(f"seq_len={seq_len} is shorter than the longest row ({longest} tokens, seq_len "
                        f"{longest - 1}); pass seq_len=None (the longest row) or max_length to cut rows.")
    return seq_len


def _each_row(table: Table):
    if not table.rows:
        raise DataError(f"{table.source}: no rows; add some examples.")
    return zip(table.labels, table.rows)


def sft_arrays(source: str | os.PathLike | Table, tokenizer: Tokenizer, *, max_length: int | None = None,
               seq_len: int | None = None, template_kwargs: dict | None = None) -> Encoded:
    """SFT rows from `source` (prompt/completion, messages or text): the arrays of
    `data.sft_arrays` (`inputs_NxL`, `targets_NxL`, `loss_mask_NxL`, `attention_mask_NxL`).

    L = `seq_len`, or by default the longest row (after truncation) less one. `template_kwargs`
    reach the chat template (e.g. `{"enable_thinking": False}` for Qwen3).
    """
    _check_max_length(max_length)
    tokenizer = _rendering(tokenizer, template_kwargs)
    table = source if isinstance(source, Table) else read_table(source)
    fmt = detect_format(table, "sft")
    rows, n_cut, conversational = [], 0, fmt == "messages"
    for label, row in _each_row(table):
        encoded = _sft_row(tokenizer, label, row, fmt)
        conversational |= isinstance(row.get("prompt"), list)
        encoded, cut = _fit(label, "the row", encoded, max_length, keep_start=fmt == "language_modeling")
        rows.append(encoded)
        n_cut += cut
    return Encoded(_stack_rows(rows, tokenizer.pad_id, _seq_len(rows, seq_len)), fmt, conversational, n_cut)


# ---------------------------------------------------------------- preferences


def _common_prefix(chosen, rejected):
    """TRL's implicit prompt: the common leading messages, or for strings the common leading
    characters, backed off so that a space starts the answers rather than ends the prompt."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and n and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _split_pair(label: str, row: dict, fmt: str):
    """(prompt, chosen, rejected) of a preference row, the implicit prompt extracted."""
    if fmt == "preference":
        _check_row(label, row, ("prompt", "chosen", "rejected"))
        return row["prompt"], row["chosen"], row["rejected"]
    _check_row(label, row, ("chosen", "rejected"))
    prompt, chosen, rejected = _common_prefix(row["chosen"], row["rejected"])
    for field, rest in (("chosen", chosen), ("rejected", rejected)):
        if not prompt or not (rest.strip() if isinstance(rest, str) else rest):
            raise DataError(f"{label}: 'chosen' and 'rejected' must start with the same prompt and then differ "
                            f"({'no common start' if not prompt else f'{field!r} has nothing after it'}); "
                            "or give the prompt in its own 'prompt' column.")
    return prompt, chosen, rejected


def _fit_pair(label: str, chosen: Row, rejected: Row, max_length: int | None) -> tuple[Row, Row, bool]:
    """Both rows cut by the same number of prompt tokens, so row i is one prompt on both sides."""
    excess = max(len(chosen.ids), len(rejected.ids)) - (max_length or 0)
    if max_length is None or excess <= 0:
        return chosen, rejected, False
    for field, row in (("chosen", chosen), ("rejected", rejected)):
        room = row.cut_to - row.cut_from
        if len(row.ids) - room > max_length:
            raise _too_long(label, f"field {field!r}", len(row.ids) - room, max_length)
    n = min(excess, chosen.cut_to - chosen.cut_from, rejected.cut_to - rejected.cut_from)
    return cut_prompt(chosen, n), cut_prompt(rejected, n), True


def preference_arrays(source: str | os.PathLike | Table, tokenizer: Tokenizer, *,
                      max_length: int | None = None, seq_len: int | None = None,
                      template_kwargs: dict | None = None) -> Encoded:
    """DPO pairs from `source`: the arrays of `data.preference_arrays` (`chosen_inputs_NxL`, ...,
    `rejected_attention_mask_NxL`), both sides padded to one L, the prompt cut alike on both."""
    _check_max_length(max_length)
    tokenizer = _rendering(tokenizer, template_kwargs)
    table = source if isinstance(source, Table) else read_table(source)
    fmt = detect_format(table, "dpo")
    chosen_rows, rejected_rows, n_cut, conversational = [], [], 0, False
    for label, row in _each_row(table):
        prompt, chosen, rejected = _split_pair(label, row, fmt)
        conversational |= isinstance(prompt, list)
        c, r, cut = _fit_pair(label, _prompt_completion_row(tokenizer, label, prompt, chosen),
                              _prompt_completion_row(tokenizer, label, prompt, rejected), max_length)
        chosen_rows.append(c)
        rejected_rows.append(r)
        n_cut += cut
    length = _seq_len(chosen_rows + rejected_rows, seq_len)
    arrays = {f"chosen_{k}": v for k, v in _stack_rows(chosen_rows, tokenizer.pad_id, length).items()}
    arrays.update({f"rejected_{k}": v for k, v in _stack_rows(rejected_rows, tokenizer.pad_id, length).items()})
    return Encoded(arrays, fmt, conversational, n_cut)


# ---------------------------------------------------------------- prompts (GRPO)


def _prompt_row(tokenizer, label: str, prompt) -> Row:
    """`[bos] + prompt` (standard), or the template's rendering with the generation prompt;
    the generation prompt (assistant header) is never cut."""
    if isinstance(prompt, str):
        ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
        return Row(ids, [False] * len(ids), 1, len(ids))
    _needs_template(tokenizer, label)
    text = _render(tokenizer, label, prompt, True)
    ids = tokenizer.encode(text)
    head = 1 if ids and ids[0] == tokenizer.bos_id else 0
    history = _boundary(tokenizer, label, text, ids, _render(tokenizer, label, prompt, False))
    return Row(ids, [False] * len(ids), head, max(head, history))


def prompt_arrays(source: str | os.PathLike | Table, tokenizer: Tokenizer, *,
                  max_length: int | None = None, prompt_len: int | None = None,
                  template_kwargs: dict | None = None) -> Encoded:
    """GRPO prompts from `source`: the rows of `sampler.prompt_rows` (`prompt_tokens_NxP` and
    `prompt_mask_NxP` LEFT-padded, `index_N`), and `examples`: the rows as read (`prompt` as
    in the file, every other column for the reward functions); for `grpo.make_rollout(...,
    rows=encoded.arrays)` with `examples=encoded.examples`.

    `max_length` bounds the prompt's tokens (TRL's `max_prompt_length`); P = `prompt_len`,
    or by default the longest prompt kept."""
    _check_max_length(max_length)
    tokenizer = _rendering(tokenizer, template_kwargs)
    table = source if isinstance(source, Table) else read_table(source)
    fmt = detect_format(table, "grpo")
    rows, n_cut, conversational = [], 0, False
    for label, row in _each_row(table):
        conversational |= _check_field(label, row, "prompt", None)
        encoded, cut = _fit(label, "the prompt's generation header", _prompt_row(tokenizer, label, row["prompt"]),
                            max_length)
        rows.append(encoded)
        n_cut += cut
    width = max(len(r.ids) for r in rows)
    if prompt_len is not None:
        if prompt_len < width:
            raise DataError(f"{table.source}: prompt_len={prompt_len} is shorter than the longest prompt ({width} "
                            f"tokens); raise prompt_len, or pass max_length={prompt_len} to cut prompts' starts.")
        width = prompt_len
    tokens = np.full((len(rows), width), tokenizer.pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), width), dtype=np.int32)
    for i, r in enumerate(rows):
        tokens[i, width - len(r.ids):] = r.ids
        mask[i, width - len(r.ids):] = 1
    arrays = {"prompt_tokens": tokens, "prompt_mask": mask, "index": np.arange(len(rows))}
    return Encoded(arrays, fmt, conversational, n_cut, examples=[dict(row) for row in table.rows])


ENCODERS = {"sft": sft_arrays, "dpo": preference_arrays, "grpo": prompt_arrays}
