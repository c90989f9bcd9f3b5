"""Sequence packing for SFT and distillation: several examples per row, none attending to another.

A batch of right-padded rows (`data.sft_arrays`) whose lengths vary wastes the padding's
compute: with lengths uniform over 16 to 256 tokens at 256 a row, about half of it.
Packing lays the examples end to end in rows of `max_length` tokens and marks each token
with a segment id (1, 2, ... for the examples of a row, 0 for padding); the model
(`model.apply(..., segment_ids_BxL=..., positions_BxL=...)`) then lets a token attend
only to earlier tokens of its own example, and RoPE positions restart at 0 for each
example. So every example's logits are those it gets alone, and the kit's reductions,
which are sums and weights, give the same loss sum, token count and gradients.

- `pack` places the examples with first-fit-decreasing (fewest rows; `next_fit` keeps
  their order), a pure, deterministic function of the lengths, so `packed_batch_at` is
  a pure function of (seed, step) like `data.batch_at`.
- `padding_free` (TRL's `padding_free`): the whole batch as one row, padded only up to a
  multiple of `pad_to_multiple_of`. Under `jit` every distinct shape compiles once; the
  alignment bounds how many shapes a run meets, at fewer than `pad_to_multiple_of` pad
  tokens per batch. With the kit's dense attention the one long row costs attention
  over (batch tokens)^2 scores, most of them masked: it pays only with a kernel that
  skips the masked blocks (varlen flash attention, which TRL relies on).
- `sft_objective`, `distill_objective`: the methods' objectives on packed batches. SFT's
  loss is already a token sum. Distillation's loss is a mean over each example's tokens,
  then a sum over examples: `segment_means` does that reduction per segment.

`python -m tunix_nb.bench --only packing` measures padding against packing and padding-free
on `synthetic_examples` (`tunix_nb.bench.packing`): results/bench.json's "packing" record.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tunix_nb import data, losses, sft, vocab_chunks
from tunix_nb import model as model_lib
from tunix_nb.model import segment_keywords  # its former home: packing.segment_keywords still works
from tunix_nb.precision import cast_floats, resolve_compute_dtype

STRATEGIES = ("first_fit_decreasing", "next_fit")
ROW_KEYS = ("inputs", "targets", "loss_mask", "attention_mask")  # what data.sft_arrays gives


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """How a batch of examples becomes packed rows."""

    max_length: int = 256  # tokens per packed row; no example may be longer
    strategy: str = "first_fit_decreasing"  # or "next_fit": fill rows in the examples' order
    # A static row count (packed rows; padding-free is one row), so that one compiled
    # step serves every batch: the rows the packer does not need are all padding, and a
    # batch that needs more raises an error naming the count. None: as many as it needs.
    num_rows: int | None = None
    padding_free: bool = False  # one row holding the whole batch (see the module's docstring)
    pad_to_multiple_of: int = 128  # padding-free only: the row's length is a multiple of this

    def __post_init__(self):
        for name in ("max_length", "pad_to_multiple_of"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PackingConfig.{name} must be a positive int, got {value!r}.")
        if self.num_rows is not None and (isinstance(self.num_rows, bool) or self.num_rows < 1):
            raise ValueError(f"PackingConfig.num_rows must be a positive int or None, got {self.num_rows!r}.")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"PackingConfig.strategy must be one of {STRATEGIES}, got {self.strategy!r}.")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each example of a packed batch lies: example i fills row `row_N[i]`, tokens
    [start_N[i], start_N[i] + length_N[i]), as segment `segment_N[i]` of that row."""

    row_N: np.ndarray
    start_N: np.ndarray
    length_N: np.ndarray
    segment_N: np.ndarray
    shape: tuple[int, int]  # the packed batch's [rows, row length]

    @property
    def padding_fraction(self) -> float:
        """The share of the packed batch's token slots that hold no example."""
        return 1.0 - float(self.length_N.sum()) / (self.shape[0] * self.shape[1])


# ------------------------------------------------------------------------- the packer


def example_lengths(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """Each right-padded row's real tokens [N] (its attention mask's ones), checked."""
    missing = [k for k in ROW_KEYS if k not in arrays]
    if missing:
        raise data.DataError(f"packing needs the arrays {list(ROW_KEYS)} (data.sft_arrays gives them); "
                             f"missing {missing}.")
    mask_NxL = np.asarray(arrays["attention_mask"])
    lengths_N = mask_NxL.sum(axis=1).astype(np.int64)
    right_padded_NxL = np.arange(mask_NxL.shape[1])[None, :] < lengths_N[:, None]
    bad = np.flatnonzero((mask_NxL.astype(bool) != right_padded_NxL).any(axis=1))
    if bad.size:
        raise data.DataError(f"example {bad[0]}: its attention_mask is not ones then zeros; packing takes "
                             "right-padded rows (data.sft_arrays), not left-padded prompts.")
    stray = np.flatnonzero(((np.asarray(arrays["loss_mask"]) != 0) & ~right_padded_NxL).any(axis=1))
    if stray.size:
        raise data.DataError(f"example {stray[0]}: loss_mask is 1 on a padding position; a loss position "
                             "must be a real token (attention_mask 1).")
    return lengths_N


def _check_fits(lengths_N: np.ndarray, max_length: int) -> None:
    too_long = np.flatnonzero(lengths_N > max_length)
    if too_long.size:
        i = int(too_long[0])
        raise data.DataError(
            f"example {i} has {int(lengths_N[i])} tokens but a packed row holds max_length={max_length} "
            f"({too_long.size} example(s) too long); raise PackingConfig.max_length to "
            f"{int(lengths_N.max())}, or encode the examples to fit (data.sft_arrays(..., "
            f"seq_len={max_length}, truncate=True)).")


def first_fit_decreasing(lengths_N: Sequence[int], max_length: int) -> list[list[int]]:
    """Rows of example indices: longest first, each into the first row with room.

    Ties keep the examples' order (a stable sort), so the rows are a pure function of
    the lengths. FFD uses at most 11/9 of the optimal number of rows, plus one.
    """
    lengths_N = np.asarray(lengths_N)
    _check_fits(lengths_N, max_length)
    rows, room = [], []
    for i in np.argsort(-lengths_N, kind="stable"):
        n = int(lengths_N[i])
        r = next((r for r, free in enumerate(room) if free >= n), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(max_length)
        rows[r].append(int(i))
        room[r] -= n
    return rows


def next_fit(lengths_N: Sequence[int], max_length: int) -> list[list[int]]:
    """Rows of example indices in the examples' order: a new row when the next one does not fit."""
    lengths_N = np.asarray(lengths_N)
    _check_fits(lengths_N, max_length)
    rows, used = [[]], 0
    for i, n in enumerate(lengths_N.tolist()):
        if used + n > max_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows if rows[0] else []


def _layout(rows: list[list[int]], lengths_N: np.ndarray, shape: tuple[int, int]) -> Layout:
    n = len(lengths_N)
    row_N, start_N, segment_N = (np.zeros(n, np.int64) for _ in range(3))
    for r, members in enumerate(rows):
        offset = 0
        for segment, i in enumerate(members, start=1):
            row_N[i], start_N[i], segment_N[i] = r, offset, segment
            offset += int(lengths_N[i])
    return Layout(row_N, start_N, lengths_N.copy(), segment_N, shape)


def _fill(arrays: Mapping[str, np.ndarray], layout: Layout) -> dict[str, np.ndarray]:
    """The packed batch: the row arrays moved to their places, with segment ids and positions."""
    R, L = layout.shape
    packed = {k: np.zeros((R, L), np.asarray(arrays[k]).dtype) for k in ROW_KEYS}
    packed["segment_ids"] = np.zeros((R, L), np.int32)
    packed["positions"] = np.zeros((R, L), np.int32)
    for i, (r, start, n) in enumerate(zip(layout.row_N, layout.start_N, layout.length_N)):
        span = slice(start, start + n)
        for k in ROW_KEYS:
            packed[k][r, span] = np.asarray(arrays[k])[i, :n]
        packed["segment_ids"][r, span] = layout.segment_N[i]
        packed["positions"][r, span] = np.arange(n)
    return packed


def pack(arrays: Mapping[str, np.ndarray], cfg: PackingConfig = PackingConfig()) -> tuple[dict, Layout]:
    """(packed batch, layout) of a batch of right-padded rows (`data.sft_arrays`, `data.batch_at`).

    The batch holds `inputs`, `targets`, `loss_mask`, `attention_mask` (1 = a real
    token), `segment_ids` and `positions`, all [rows, row length]: `max_length` for
    packed rows, or one row for `padding_free`. A pure function of `arrays` and `cfg`.
    """
    lengths_N = example_lengths(arrays)
    if cfg.padding_free:
        total = int(lengths_N.sum())
        row_length = -(-total // cfg.pad_to_multiple_of) * cfg.pad_to_multiple_of
        rows = [list(range(len(lengths_N)))]
    else:
        row_length = cfg.max_length
        rows = (first_fit_decreasing if cfg.strategy == "first_fit_decreasing" else next_fit)(
            lengths_N, cfg.max_length)
    n_rows = len(rows)
    if cfg.num_rows is not None and not cfg.padding_free:
        if n_rows > cfg.num_rows:
            raise data.DataError(f"this batch of {len(lengths_N)} examples needs {n_rows} packed rows but "
                                 f"PackingConfig.num_rows={cfg.num_rows}; raise num_rows or lower the batch size.")
        n_rows = cfg.num_rows
    layout = _layout(rows, lengths_N, (n_rows, row_length))
    return _fill(arrays, layout), layout


def packed_batch_at(arrays: Mapping[str, np.ndarray], step: int, batch_size: int, *, seed: int,
                    cfg: PackingConfig = PackingConfig()) -> tuple[dict, Layout]:
    """`data.batch_at`'s examples for (seed, step), packed: a pure function of (seed, step)."""
    return pack(data.batch_at(arrays, step, batch_size, seed=seed), cfg)


def rows_needed(arrays: Mapping[str, np.ndarray], *, steps: int, batch_size: int, seed: int,
                cfg: PackingConfig = PackingConfig()) -> int:
    """The most packed rows any of the steps 0 ... steps - 1 needs (`packed_batch_at`'s
    batches): a `PackingConfig.num_rows` that serves a whole run, so that one compiled step
    trains on every batch. A pure function of its arguments, as the packer is; it packs
    each step's lengths once (about a millisecond a step for 64 examples)."""
    if cfg.padding_free:
        return 1
    lengths_N = example_lengths(arrays)
    pack_rows = first_fit_decreasing if cfg.strategy == "first_fit_decreasing" else next_fit
    return max(len(pack_rows(data.batch_at({"length": lengths_N}, step, batch_size, seed=seed)["length"],
                             cfg.max_length)) for step in range(steps))


def unpack(values_RxL, layout: Layout, fill=0) -> np.ndarray:
    """Per-token values of a packed batch (e.g. logits [R, L, ...]) back in the examples'
    order, right-padded to the longest example: [N, max length, ...]."""
    values_RxL = np.asarray(values_RxL)
    out = np.full((len(layout.length_N), int(layout.length_N.max()), *values_RxL.shape[2:]), fill,
                  values_RxL.dtype)
    for i, (r, start, n) in enumerate(zip(layout.row_N, layout.start_N, layout.length_N)):
        out[i, :n] = values_RxL[r, start:start + n]
    return out


def padding_fraction(attention_mask_BxL) -> float:
    """The share of a batch's token slots that are padding (attention mask 0)."""
    mask = np.asarray(attention_mask_BxL)
    return 1.0 - float(mask.sum()) / mask.size


# ------------------------------------------------------------------- the objectives


def apply_packed(graphdef, params, batch):
    """Logits [R, L, V] of a packed batch: each example attends only to itself."""
    return model_lib.apply(graphdef, params, batch["inputs"], batch["attention_mask"], **segment_keywords(batch))


def sft_objective(graphdef, *, compute_dtype="auto", vocab_chunk=None, seq_chunk=None):
    """`sft.objective`, which reads a packed batch's segment ids: (NLL summed over completion
    tokens, token count, {}). The same sums as the unpacked batch's, so `train.make_step`
    trains on either alike, and the chunked log-probs (`vocab_chunk`) serve both.
    """
    return sft.objective(graphdef, compute_dtype=compute_dtype, vocab_chunk=vocab_chunk, seq_chunk=seq_chunk)


def segment_means(values_BxL, mask_BxL, segment_ids_BxL):
    """(sum over segments of each segment's masked mean, number of segments) of packed rows.

    The per-example reduction of `losses.distillation_loss` (a mean over each example's
    masked tokens, exactly 0 for an example whose mask is empty, which still counts),
    done per segment: a segment is a (row, id > 0) pair that holds at least one token.
    """
    B, L = segment_ids_BxL.shape
    # One bin per (row, id); ids are at most L (each segment has a token), 0 is padding.
    bins_BxL = jnp.arange(B)[:, None] * (L + 1) + segment_ids_BxL
    mask_BxL = jnp.asarray(mask_BxL, jnp.float32)
    sums_S = jax.ops.segment_sum((values_BxL * mask_BxL).reshape(-1), bins_BxL.reshape(-1), B * (L + 1))
    counts_S = jax.ops.segment_sum(mask_BxL.reshape(-1), bins_BxL.reshape(-1), B * (L + 1))
    tokens_S = jax.ops.segment_sum(jnp.ones(B * L, jnp.float32), bins_BxL.reshape(-1), B * (L + 1))
    present_S = (tokens_S > 0) & (jnp.arange(B * (L + 1)) % (L + 1) > 0)
    means_S = jnp.where(present_S, sums_S / jnp.maximum(counts_S, 1.0), 0.0)
    return jnp.sum(means_S), jnp.sum(present_S).astype(jnp.float32)


def per_token_divergence(student_logits_BxLxV, teacher_logits_BxLxV, *, temperature, beta):
    """The distillation soft term at each position [B, L]: `losses.generalized_jsd_per_example`
    (beta 0: T^2 KL(teacher || student), the soft term of `kl_distillation_per_example`)
    of each position taken as a one-token example, so the kit's one copy of the math."""
    def one_token(s_V, t_V):
        dummy_target, one = jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.float32)
        return losses.generalized_jsd_per_example(s_V[None], t_V[None], dummy_target, one, beta=beta,
                                                  temperature=temperature)

    return jax.vmap(jax.vmap(one_token))(student_logits_BxLxV, teacher_logits_BxLxV)


def distill_objective(student_graphdef, teacher_graphdef, *, temperature=2.0, alpha=0.5, beta=0.0,
                      compute_dtype="auto", vocab_chunk=None, seq_chunk=None):
    """`distill.objective` on packed batches: (sum of per-example losses, examples, metrics).

    Student and teacher both run on the packed rows. Each example's loss is
    alpha * soft + (1 - alpha) * hard, both means over its own masked tokens
    (`segment_means`), as `losses.distillation_loss` computes them row by row. Metrics are
    (sum, count) pairs, exact however the examples fall across devices. GKD's on-policy
    rows (`own_sample`) are not packed. `vocab_chunk` (and `seq_chunk`): both models'
    per-position terms from their hidden states in chunks (`tunix_nb.vocab_chunks`), no
    [R, L, V] logits; None, the default, is the full-logits reference.
    """
    compute_dtype = resolve_compute_dtype(compute_dtype)
    chunks = vocab_chunks.chunking(vocab_chunk, seq_chunk)
    terms = functools.partial(_full_terms if chunks is None else _chunked_terms, student_graphdef, teacher_graphdef,
                              temperature=temperature, beta=beta, skip_teacher=alpha == 0.0, chunks=chunks)

    def packed_distill_objective(params, batch, teacher_params):
        if "own_sample" in batch:
            raise ValueError("packed distillation has no per-row `own_sample` (GKD); train GKD on unpacked rows.")
        soft_RxL, hard_RxL = terms(cast_floats(params, compute_dtype), cast_floats(teacher_params, compute_dtype),
                                   batch)
        mask, segments = batch["loss_mask"], batch["segment_ids"]
        soft_sum, n = segment_means(soft_RxL, mask, segments)
        hard_sum, _ = segment_means(hard_RxL, mask, segments)
        loss_sum = alpha * soft_sum + (1 - alpha) * hard_sum
        return loss_sum, n, {"distill/soft_loss": (soft_sum, n), "distill/hard_loss": (hard_sum, n)}

    return packed_distill_objective


def _full_terms(student_graphdef, teacher_graphdef, params, teacher_params, batch, *, temperature, beta,
                skip_teacher, chunks=None):
    """(soft [R, L], hard [R, L]) per position from both models' full logits."""
    student_RxLxV = apply_packed(student_graphdef, params, batch)
    if skip_teacher:  # hard labels only: no soft term, skip the teacher (as distill.objective does)
        teacher_RxLxV = jax.lax.stop_gradient(student_RxLxV)
    else:
        teacher_RxLxV = jax.lax.stop_gradient(apply_packed(teacher_graphdef, teacher_params, batch))
    soft_RxL = per_token_divergence(student_RxLxV, teacher_RxLxV, temperature=temperature, beta=beta)
    return soft_RxL, -losses.token_log_probs(student_RxLxV, batch["targets"])


def _chunked_terms(student_graphdef, teacher_graphdef, params, teacher_params, batch, *, temperature, beta,
                   skip_teacher, chunks):
    """The same terms from hidden states, a chunk of the vocabulary at a time (`vocab_chunks`)."""
    def hidden_and_head(graphdef, p):
        hidden_RxLxD = model_lib.hidden_states(graphdef, p, batch["inputs"], batch["attention_mask"],
                                               **segment_keywords(batch))
        return hidden_RxLxD, model_lib.output_head(graphdef, p)

    hidden, head = hidden_and_head(student_graphdef, params)
    teacher_hidden, teacher_head = (hidden, head) if skip_teacher else hidden_and_head(teacher_graphdef,
                                                                                       teacher_params)
    out = vocab_chunks.per_position(hidden, head, batch["targets"], batch["loss_mask"], chunks=chunks,
                                    temperature=temperature, divergence=vocab_chunks.divergence_for(beta), beta=beta,
                                    teacher_hidden_BxLxD=teacher_hidden, teacher_head=teacher_head)
    return temperature**2 * out["divergence"], -out["target_logp"]


# ---------------------------------------------------------------- a skewed batch


def synthetic_examples(n: int, *, min_length: int = 16, max_length: int = 256, vocab_size: int = 259,
                       seed: int = 0) -> dict[str, np.ndarray]:
    """n rows laid out as `data.sft_arrays` lays them out, at seq_len `max_length`: each
    example's length (prompt + completion tokens) uniform over [min_length, max_length],
    its prompt uniform over [1, length - 2], random tokens; the loss on the completion."""
    rng = np.random.default_rng(seed)
    lengths_N = rng.integers(min_length, max_length + 1, n)
    prompts_N = rng.integers(1, lengths_N - 1)
    t_L = np.arange(max_length)
    row_NxL1 = rng.integers(3, vocab_size, (n, max_length + 1)).astype(np.int32)
    real_NxL1 = np.arange(max_length + 1)[None, :] < lengths_N[:, None]
    row_NxL1 = np.where(real_NxL1, row_NxL1, 0)  # 0: the pad id
    return {"inputs": row_NxL1[:, :-1], "targets": row_NxL1[:, 1:],
            "loss_mask": ((t_L >= prompts_N[:, None]) & (t_L < lengths_N[:, None] - 1)).astype(np.float32),
            "attention_mask": (t_L < lengths_N[:, None]).astype(np.int32)}
