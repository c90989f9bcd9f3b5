"""Data: a small synthetic instruction task, validated loading, and training batches.

The task has four templated sub-tasks, each checkable by exact match and small
enough for a tiny byte-level transformer to learn on a CPU in a few hundred steps:

    add      "add 37+5="        -> "42"      two numbers 0..99
    reverse  "rev tomal="       -> "lamot"   a made-up word of 3-5 letters
    sort     "sort 5193="       -> "1359"    3-5 digits
    swap     "swap a>o banan="  -> "bonon"   every `a` becomes `o` (one way, not a>o and o>a)

Rows (what the model consumes): `[bos] + prompt + completion + [eos]`, right-padded
to seq_len + 1 tokens, then `inputs = row[:-1]` and `targets = row[1:]`. The loss
counts only the targets that are completion tokens or the final eos, so the model
learns to answer, not to predict prompts. This module needs only NumPy: JAX accepts
the int32/float32 arrays it returns.

Regenerate the shipped files with `python -m tunix_nb.data --out data`.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import warnings
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from tunix_nb.tokenizer import Tokenizer

# The repo's data/ folder, found from the package so notebooks can load it from anywhere.
DATA_DIR = Path(__file__).resolve().parent.parent / "data"

TASKS = ("add", "reverse", "sort", "swap")

# Fixed seeds and sizes of the shipped files; changing any changes the files.
SFT_TRAIN_SEED, SFT_EVAL_SEED = 1234, 5678
PREF_TRAIN_SEED, PREF_EVAL_SEED = 4321, 8765
N_SFT_TRAIN, N_SFT_EVAL = 4000, 200
N_PREF_TRAIN, N_PREF_EVAL = 2000, 200

# Longest prompt is "swap a>o banan=" (15 bytes), longest completion 5 bytes, so the
# longest row is 1 + 15 + 5 + 1 = 22 tokens: seq_len 21. The tests check these bounds.
DEFAULT_SEQ_LEN = 24
DEFAULT_PROMPT_LEN = 16  # bos + the longest prompt
MAX_NEW_TOKENS = 8  # the longest completion + eos, with room to spare
# DEFAULT_PROMPT_LEN + MAX_NEW_TOKENS == DEFAULT_SEQ_LEN: a model sized for training
# also fits a generation.

_HINT = "regenerate with `python -m tunix_nb.data --out data`"


class DataError(ValueError):
    """A data file, an example or a batch request that the pipeline cannot use."""


# ---------------------------------------------------------------- the sub-tasks

# Consonant-vowel words ("tomal") are easier to read in a notebook than random letters.
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _word(rng: random.Random, lo: int, hi: int) -> str:
    n = rng.randint(lo, hi)
    vowel = rng.random() < 0.5
    letters = []
    for _ in range(n):
        letters.append(rng.choice(_VOWELS if vowel else _CONSONANTS))
        vowel = not vowel
    return "".join(letters)


def _carry_dropped(a: int, b: int) -> int:
    """a + b computed digit by digit, forgetting every carry: 37+5 -> 32."""
    out, place = 0, 1
    while a or b:
        out += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def _adjacent_swaps(s: str) -> list[str]:
    """s with one adjacent pair of different characters swapped, for each such pair."""
    return [s[:i] + s[i + 1] + s[i] + s[i + 2 :] for i in range(len(s) - 1) if s[i] != s[i + 1]]


# Each sub-task: sample(rng) -> (prompt, answer, wrong answers). The wrong answers
# are the mistakes a learner (or a half-trained model) makes, for DPO's `rejected`.


def _add(rng: random.Random) -> tuple[str, str, list[str]]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    s = a + b
    wrong = [_carry_dropped(a, b), s + 1, s - 1]
    return f"add {a}+{b}=", str(s), [str(w) for w in wrong if w >= 0]


def _reverse(rng: random.Random) -> tuple[str, str, list[str]]:
    w = _word(rng, 3, 5)
    r = w[::-1]
    # Not reversed at all; reversed but with the ends left in place; one slip.
    wrong = [w, w[0] + w[1:-1][::-1] + w[-1]]
    swaps = _adjacent_swaps(r)
    if swaps:
        wrong.append(rng.choice(swaps))
    return f"rev {w}=", r, wrong


def _sort(rng: random.Random) -> tuple[str, str, list[str]]:
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(3, 5)))
    s = "".join(sorted(digits))
    wrong = []
    swaps = _adjacent_swaps(s)  # one pair out of order
    if swaps:
        wrong.append(rng.choice(swaps))
    i = rng.randrange(len(s))  # one digit off by one
    d = int(s[i])
    d += rng.choice([delta for delta in (-1, 1) if 0 <= d + delta <= 9])
    wrong.append(s[:i] + str(d) + s[i + 1 :])
    return f"sort {digits}=", s, wrong


def _swap(rng: random.Random) -> tuple[str, str, list[str]]:
    w = _word(rng, 3, 5)
    x = rng.choice(w)  # from the letters, so a repeated letter is picked more often
    y = rng.choice([c for c in string.ascii_lowercase if c != x])
    out = w.replace(x, y)
    # One occurrence left unreplaced (for a single occurrence, that is the word itself).
    p = rng.choice([i for i, c in enumerate(w) if c == x])
    return f"swap {x}>{y} {w}=", out, [out[:p] + x + out[p + 1 :]]


_SAMPLERS: dict[str, Callable[[random.Random], tuple[str, str, list[str]]]] = {
    "add": _add,
    "reverse": _reverse,
    "sort": _sort,
    "swap": _swap,
}


# ---------------------------------------------------------------- the long family (opt-in)

# Reversing and sorting 6-14 symbols, for the lessons whose methods need long answers
# (GRPO's pass@k, on-policy distillation's compounding errors: lessons 08 and 11). Opt-in:
# `generate_sft(..., family="long")`; nothing above, nor the shipped files, changes.
LONG_TASKS = ("long_reverse", "long_sort")
LONG_MIN, LONG_MAX = 6, 14
# Longest prompt "sort " + 14 digits + "=" (20 bytes), longest answer 14: a row is
# 1 + 20 + 14 + 1 = 36 tokens (seq_len 35, one to spare); generation: bos + prompt in 21,
# answer + eos in 15. As for the short family, LONG_PROMPT_LEN + LONG_MAX_NEW_TOKENS ==
# LONG_SEQ_LEN: a sampled row is as long as a training row.
LONG_SEQ_LEN = 36
LONG_PROMPT_LEN = 21
LONG_MAX_NEW_TOKENS = 15


def _long_reverse(rng: random.Random) -> tuple[str, str, list[str]]:
    w = _word(rng, LONG_MIN, LONG_MAX)
    return f"rev {w}=", w[::-1], [w]


def _long_sort(rng: random.Random) -> tuple[str, str, list[str]]:
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(LONG_MIN, LONG_MAX)))
    s = "".join(sorted(digits))
    return f"sort {digits}=", s, _adjacent_swaps(s)[:1]


_LONG_SAMPLERS: dict[str, Callable[[random.Random], tuple[str, str, list[str]]]] = {
    "long_reverse": _long_reverse,
    "long_sort": _long_sort,
}

# ---------------------------------------------------------------- the count family (opt-in)

# Running counts: for 6-14 bits, answer digit i is the number of 1s among the first i, mod 10
# ("cnt 1011=" -> "1123"). Each digit is the one before it plus the next bit, a local rule a
# model picks up from right prefixes, and which carries a slip into every later digit; a
# model that also saw wrong prefixes counts from the input again. Lesson 11's second design,
# where errors compound. Rows fit the long family's lengths ("cnt " + 14 bits + "=": 19 bytes).
# Prompts are unique and there are only 2^n strings of n bits, so the short lengths run out:
# a split drawn after others holds mostly long answers (`tunix_nb.experiments.count_family`).
COUNT_TASKS = ("running_count",)


def running_counts(bits: str) -> str:
    """'1011' -> '1123': each digit the number of 1s up to it, mod 10."""
    total, out = 0, []
    for bit in bits:
        total = (total + int(bit)) % 10
        out.append(str(total))
    return "".join(out)


def _running_count(rng: random.Random, min_bits: int = LONG_MIN) -> tuple[str, str, list[str]]:
    bits = "".join(rng.choice("01") for _ in range(rng.randint(min_bits, LONG_MAX)))
    return f"cnt {bits}=", running_counts(bits), []


def _running_count_of_14_bits(rng: random.Random) -> tuple[str, str, list[str]]:
    return _running_count(rng, min_bits=LONG_MAX)


# "count14": the same running counts, always of LONG_MAX = 14 bits, so that a model never has
# to guess where its answer ends (lesson 11's fourth design, `tunix_nb.experiments.count14_family`)
FAMILIES = {"short": (TASKS, _SAMPLERS), "long": (LONG_TASKS, _LONG_SAMPLERS),
            "count": (COUNT_TASKS, {"running_count": _running_count}),
            "count14": (COUNT_TASKS, {"running_count": _running_count_of_14_bits})}


def _generate(n: int, seed: int, exclude: Iterable[str], preferences: bool, family: str = "short") -> list[dict]:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}.")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}.")
    tasks, samplers = FAMILIES[family]
    rng = random.Random(seed)
    seen = set(exclude)  # prompts are unique within a file and never in `exclude`
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]  # cycle, then shuffle: exactly balanced, random order
        for _ in range(10_000):
            prompt, answer, wrong = samplers[task](rng)
            wrong = [w for w in dict.fromkeys(wrong) if w and w != answer]
            if prompt not in seen and (wrong or not preferences):
                break
        else:  # e.g. `add` has only 10,000 distinct prompts
            raise ValueError(f"ran out of new {task!r} prompts after {i} examples; ask for fewer (lower n).")
        seen.add(prompt)
        if preferences:
            out.append({"prompt": prompt, "chosen": answer, "rejected": rng.choice(wrong), "task": task})
        else:
            out.append({"prompt": prompt, "completion": answer, "task": task})
    rng.shuffle(out)
    return out


def generate_sft(n: int, seed: int, *, exclude: Iterable[str] = (), family: str = "short") -> list[dict]:
    """n SFT examples {prompt, completion, task}, balanced over the sub-tasks.

    Prompts are unique and never one of `exclude` (to keep eval apart from train).
    `family="long"`: the long family's sub-tasks (`LONG_TASKS`, answers of 6-14 symbols;
    encode them with `LONG_SEQ_LEN`, generate with `LONG_PROMPT_LEN` and `LONG_MAX_NEW_TOKENS`);
    `family="count"`: running counts of 6-14 bits (`COUNT_TASKS`), at the same lengths;
    `family="count14"`: running counts of exactly 14 bits.
    """
    return _generate(n, seed, exclude, preferences=False, family=family)


def generate_preferences(n: int, seed: int, *, exclude: Iterable[str] = ()) -> list[dict]:
    """n preference pairs {prompt, chosen, rejected, task}; rejected is a plausible mistake.

    add: carries dropped or off by one. reverse: not reversed, ends left in place, or
    one adjacent pair swapped. sort: one adjacent pair swapped or one digit off by one.
    swap: one occurrence not replaced. rejected is never empty nor equal to chosen.
    """
    return _generate(n, seed, exclude, preferences=True)


def _write_jsonl(path: Path, rows: list[dict], keys: Sequence[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in keys}, ensure_ascii=False, sort_keys=False) + "\n")


def write_datasets(out_dir: str | Path = "data") -> dict[str, Path]:
    """Write the four shipped files into out_dir (created if needed); returns name -> path.

    Eval prompts are drawn excluding every train prompt, so eval measures generalization.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sft_train = generate_sft(N_SFT_TRAIN, SFT_TRAIN_SEED)
    pref_train = generate_preferences(N_PREF_TRAIN, PREF_TRAIN_SEED)
    train_prompts = {r["prompt"] for r in sft_train} | {r["prompt"] for r in pref_train}
    sft_eval = generate_sft(N_SFT_EVAL, SFT_EVAL_SEED, exclude=train_prompts)
    pref_eval = generate_preferences(N_PREF_EVAL, PREF_EVAL_SEED, exclude=train_prompts)
    sft_keys, pref_keys = ("prompt", "completion", "task"), ("prompt", "chosen", "rejected", "task")
    files = {
        "sft_train.jsonl": (sft_train, sft_keys),
        "sft_eval.jsonl": (sft_eval, sft_keys),
        "preferences_train.jsonl": (pref_train, pref_keys),
        "preferences_eval.jsonl": (pref_eval, pref_keys),
    }
    paths = {}
    for name, (rows, keys) in files.items():
        paths[name] = out / name
        _write_jsonl(paths[name], rows, keys)
    return paths


# ---------------------------------------------------------------- loading

SFT_KEYS = ("prompt", "completion")
PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


def load_jsonl(path: str | Path, required_keys: Sequence[str]) -> list[dict]:
    """Read a JSONL file, checking every line; raise DataError saying where and what.

    Each line must be a JSON object whose `required_keys` are non-empty strings
    (extra keys are kept). A final newline is fine; a blank line between records is not.
    """
    where = str(path)  # as given: a short relative path reads better than an absolute one
    need = " and ".join(repr(k) for k in required_keys)
    hint = f"each line needs {need} as non-empty strings; {_HINT}"
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(f"{where}: file not found; {_HINT}, or check the path.") from None
    lines = raw.split(b"\n")
    while lines and not lines[-1].strip():  # trailing newline(s) at the end of the file
        lines.pop()
    if not lines:
        raise DataError(f"{where}: the file is empty ({_HINT}).")
    rows = []
    for n, line in enumerate(lines, start=1):
        at = f"{where} line {n}"
        if not line.strip():
            raise DataError(f"{at}: blank line between records (delete it; {hint}).")
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{at}: not valid UTF-8 ({e.reason}); save the file as UTF-8.") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{at}: malformed JSON ({e.msg} at column {e.colno}); {hint}.") from None
        if not isinstance(obj, dict):
            raise DataError(f"{at}: expected a JSON object {{...}}, got {type(obj).__name__} ({hint}).")
        for key in required_keys:
            if key not in obj:
                raise DataError(f"{at}: missing key {key!r} ({hint}).")
            value = obj[key]
            if not isinstance(value, str):
                got = f"{type(value).__name__} {value!r}"
                raise DataError(f"{at}: {key!r} must be a string, got {got} ({hint}).")
            if not value.strip():
                raise DataError(f"{at}: {key!r} is empty or only whitespace ({hint}).")
        rows.append(obj)
    return rows


def load_sft(path: str | Path | None = None) -> list[dict]:
    """SFT examples {prompt, completion, ...}; default: the shipped sft_train.jsonl."""
    return load_jsonl(DATA_DIR / "sft_train.jsonl" if path is None else path, SFT_KEYS)


def load_preferences(path: str | Path | None = None) -> list[dict]:
    """Preference pairs {prompt, chosen, rejected, ...}; default: preferences_train.jsonl."""
    return load_jsonl(DATA_DIR / "preferences_train.jsonl" if path is None else path, PREFERENCE_KEYS)


# ---------------------------------------------------------------- rows and masks


def _check_len(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise DataError(f"{name} must be a positive int, got {value!r}.")


def _encode_row(
    tokenizer: Tokenizer, prompt: str, completion: str, seq_len: int, truncate: bool | None
) -> tuple[dict[str, np.ndarray], int]:
    """One row's four arrays, and how many tokens truncation cut (0 if none).

    truncate=None: too long raises, and the message does not offer truncation.
    """
    _check_len("seq_len", seq_len)
    p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
    row = [tokenizer.bos_id, *p, *c, tokenizer.eos_id]
    room = seq_len + 1  # the row is one longer than inputs/targets: they are shifted copies
    cut = 0
    if len(row) > room:
        if 1 + len(p) + 1 > room:  # not even bos + prompt + one completion token fits
            raise DataError(
                f"prompt {prompt[:40]!r} is {len(p)} tokens; with bos and at least one "
                f"completion token it needs seq_len >= {len(p) + 1}, got seq_len={seq_len}. "
                "Raise seq_len or shorten the prompt."
            )
        if not truncate:
            alternative = "" if truncate is None else ", or pass truncate=True to cut the completion's end"
            raise DataError(
                f"example {prompt[:40]!r} needs {len(row)} tokens (bos + {len(p)} prompt + "
                f"{len(c)} completion + eos), i.e. seq_len >= {len(row) - 1}, but seq_len={seq_len}. "
                f"Raise seq_len to {len(row) - 1}{alternative}."
            )
        # Cut the completion's tail, and its eos with it: keeping eos would teach the
        # model to stop in the middle of an answer.
        cut = len(row) - room
        row = row[:room]
    n_tokens = len(row)
    row = np.array(row + [tokenizer.pad_id] * (room - n_tokens), dtype=np.int32)
    t = np.arange(seq_len)
    # targets[t] = row[t+1]; completion (and eos) occupy row[1+len(p) : n_tokens].
    loss_mask = ((t >= len(p)) & (t < n_tokens - 1)).astype(np.float32)
    # Position-based, so a tokenizer whose text ids could equal pad_id still works.
    attention_mask = (t < n_tokens).astype(np.int32)
    arrays = {"inputs": row[:-1], "targets": row[1:], "loss_mask": loss_mask, "attention_mask": attention_mask}
    return arrays, cut


def encode_sft(
    tokenizer: Tokenizer, prompt: str, completion: str, seq_len: int, *, truncate: bool = False
) -> dict[str, np.ndarray]:
    """One example as `inputs_L`, `targets_L` (int32), `loss_mask_L` (float32), `attention_mask_L` (int32).

    Too long: raises DataError, or with truncate=True cuts the completion's end (keeping
    at least one completion token) and warns. A prompt that doesn't fit always raises.
    """
    arrays, cut = _encode_row(tokenizer, prompt, completion, seq_len, truncate)
    if cut:
        warnings.warn(
            f"truncated {cut} token(s) from the end of the completion of {prompt[:40]!r} "
            f"to fit seq_len={seq_len}; raise seq_len to keep the whole answer.",
            UserWarning,
            stacklevel=2,
        )
    return arrays


def _stack(rows: list[dict[str, np.ndarray]], prefix: str = "") -> dict[str, np.ndarray]:
    return {prefix + k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _require_examples(examples: Sequence, what: str) -> None:
    if len(examples) == 0:
        raise DataError(f"no {what} to encode; load some first, e.g. with tunix_nb.data.load_sft().")


def sft_arrays(
    examples: Sequence[Mapping[str, str]], tokenizer: Tokenizer, seq_len: int, *, truncate: bool = False
) -> dict[str, np.ndarray]:
    """Stack examples {prompt, completion}: `inputs_NxL`, `targets_NxL`, `loss_mask_NxL`, `attention_mask_NxL`.

    With truncate=True, all truncations are reported in a single warning.
    """
    _require_examples(examples, "SFT examples")
    rows, n_cut = [], 0
    for ex in examples:
        arrays, cut = _encode_row(tokenizer, ex["prompt"], ex["completion"], seq_len, truncate)
        rows.append(arrays)
        n_cut += cut > 0
    if n_cut:
        warnings.warn(
            f"truncated the completion of {n_cut} of {len(examples)} examples to fit "
            f"seq_len={seq_len}; raise seq_len to keep whole answers.",
            UserWarning,
            stacklevel=2,
        )
    return _stack(rows)


def preference_arrays(
    examples: Sequence[Mapping[str, str]], tokenizer: Tokenizer, seq_len: int
) -> dict[str, np.ndarray]:
    """The four SFT arrays for (prompt, chosen) as `chosen_*` and for (prompt, rejected) as `rejected_*`.

    e.g. `chosen_inputs_NxL`, `rejected_loss_mask_NxL`; row i of both is the same prompt.
    """
    _require_examples(examples, "preference pairs")
    out = {}
    for side in ("chosen", "rejected"):
        rows = [_encode_row(tokenizer, ex["prompt"], ex[side], seq_len, None)[0] for ex in examples]
        out.update(_stack(rows, prefix=f"{side}_"))
    return out


def prompt_arrays(prompts: Sequence[str], tokenizer: Tokenizer, prompt_len: int) -> dict[str, np.ndarray]:
    """Prompts for generation: `[bos] + prompt` LEFT-padded to `tokens_NxP`, with `attention_mask_NxP`.

    Left padding puts every prompt's last token in the last column, so generation can
    append new tokens to all rows at the same position.
    """
    _check_len("prompt_len", prompt_len)
    _require_examples(prompts, "prompts")
    tokens = np.full((len(prompts), prompt_len), tokenizer.pad_id, dtype=np.int32)
    mask = np.zeros((len(prompts), prompt_len), dtype=np.int32)
    for i, prompt in enumerate(prompts):
        ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
        if len(ids) > prompt_len:
            raise DataError(
                f"prompt {i} ({prompt[:40]!r}) needs {len(ids)} tokens with bos, but "
                f"prompt_len={prompt_len}; raise prompt_len to at least {len(ids)}."
            )
        tokens[i, prompt_len - len(ids) :] = ids
        mask[i, prompt_len - len(ids) :] = 1
    return {"tokens": tokens, "attention_mask": mask}


# ---------------------------------------------------------------- batches


def batch_at(
    arrays: Mapping[str, np.ndarray], step: int, batch_size: int, *, seed: int, rows: slice | None = None
) -> dict[str, np.ndarray]:
    """The batch for training step `step`: a pure function of (seed, step).

    An epoch is N // batch_size whole batches, cut in order from a permutation of the N
    rows drawn from `np.random.default_rng([seed, epoch])`; the N % batch_size rows left
    at the end of the permutation sit that epoch out (other rows each epoch). So every
    batch is full and holds distinct examples, and an epoch shows each example at
    most once (all of them when batch_size divides N). Resuming from a checkpoint at
    step k needs no saved data-loader state.

    `rows` picks a part of the batch (e.g. `parallel.process_rows(...)`, this process's
    share in a multi-process run): only those rows are gathered.
    """
    if not arrays:
        raise DataError("batch_at got no arrays; pass e.g. the dict from sft_arrays().")
    sizes = {k: len(v) for k, v in arrays.items()}
    n = next(iter(sizes.values()))
    if len(set(sizes.values())) != 1:
        raise DataError(f"arrays have different numbers of rows {sizes}; build them from the same examples.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise DataError(f"batch_size must be a positive int, got {batch_size!r}.")
    if batch_size > n:
        raise DataError(f"batch_size={batch_size} is larger than the {n} examples; use batch_size <= {n}.")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise DataError(f"step must be an int >= 0, got {step!r}.")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"seed must be an int >= 0, got {seed!r}.")
    # a batch never spans two epochs' permutations: that is what keeps its examples distinct
    epoch, slot = divmod(int(step), n // int(batch_size))
    perm = np.random.default_rng([int(seed), epoch]).permutation(n)
    idx = perm[slot * batch_size:(slot + 1) * batch_size]
    if rows is not None:
        idx = idx[rows]
    return {k: np.asarray(v)[idx] for k, v in arrays.items()}


# ---------------------------------------------------------------- evaluation


def uneven_batch(rows_by_length: Mapping[str, np.ndarray], step: int, n_devices: int,
                 per_device: int = 4) -> dict[str, np.ndarray]:
    """A global batch [n_devices * per_device, L] whose devices hold different token counts.

    `rows_by_length`: arrays (e.g. from `sft_arrays`) of examples sorted by completion
    length. Device i takes `per_device` rows of the i-th of n_devices slices, so device 0
    holds the shortest answers and the last device the longest: the batch on which a
    per-device mean and the token-correct all-reduce disagree (lessons 03 and 06).
    """
    n_rows = len(next(iter(rows_by_length.values())))
    span = n_rows // n_devices
    if span < per_device:
        raise DataError(f"{n_rows} rows cannot give {n_devices} devices {per_device} rows each from slices of "
                        f"their own; pass at least {n_devices * per_device} rows or fewer per device.")
    idx = (np.arange(n_devices)[:, None] * span + (step * per_device + np.arange(per_device)) % span).reshape(-1)
    return {k: v[idx] for k, v in rows_by_length.items()}


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of predictions exactly equal to their reference (no stripping)."""
    if len(predictions) != len(references):
        raise ValueError(
            f"got {len(predictions)} predictions but {len(references)} references; "
            "pass one prediction per reference, in the same order."
        )
    if not references:
        raise ValueError("exact_match needs at least one prediction/reference pair.")
    return sum(p == r for p, r in zip(predictions, references)) / len(references)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tunix_nb.data",
        description="Regenerate the kit's synthetic SFT and preference data (reproducible byte for byte).",
    )
    parser.add_argument(
        "--out", default="data", help="output folder, relative to the current directory (default: data)"
    )
    args = parser.parse_args(argv)
    for name, path in write_datasets(args.out).items():
        data = path.read_bytes()
        n_lines = data.count(b"\n")
        print(f"{str(path):40s} {n_lines:5d} lines {len(data):8d} bytes")


if __name__ == "__main__":
    main()
