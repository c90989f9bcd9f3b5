"""Sampling with a key/value cache: prefill the prompt once, then decode token by token.

`model.greedy_generate` reruns the whole model on a [B, P + T] buffer for every new
token. Here the prompt runs once (prefill), writing every layer's keys and values into
a cache of fixed shape [B, S, H, D]; each new token then runs alone against the cache
(decode). Every shape is fixed up front and the decode loop is a `lax.fori_loop` inside
one `jit`, so one compiled program serves every batch of the same shape.

A rollout is a pure function of (params, prompts, key): the key of step t is
`fold_in(key, t)`, so the same key gives the same completions, on any run. With one
key per row (`key` of shape [B]) row i draws from its own key alone, so its completion
does not depend on which other rows share its batch, or its device (GRPO's data-parallel
rollouts, `tunix_nb.grpo`). This is
what Tunix's `Sampler` does (prefill, then a decode loop over a fixed-size cache, with
temperature, top-k and top-p).

On-policy sampling, which GRPO (`tunix_nb.grpo`) and on-policy distillation
(`tunix_nb.gkd`) share, sits beside it: the prompt rows (`prompt_rows`), one key per
row from (seed, step, row) (`rollout_keys`), and `make_sampler`, which samples on every
parallel strategy and returns the training rows (`training_rows`) with the sampled
tokens' log-probs as the step computes them (`completion_log_probs`).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tunix_nb import data, losses, parallel, vocab_chunks
from tunix_nb import model as model_lib
from tunix_nb.precision import cast_floats, resolve_compute_dtype
from tunix_nb.tokenizer import ByteTokenizer, Tokenizer


class Completions(NamedTuple):
    """What `generate` returns; unpacks as `tokens, mask, log_probs = generate(...)`."""

    tokens: jax.Array     # [B, T] int: the new tokens, pad after eos
    mask: jax.Array       # [B, T] int32: 1 up to and including eos, 0 after it
    log_probs: jax.Array  # [B, T] float32: log p(token) under the policy (see generate); 0 where mask is 0


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise a ValueError naming the fix for settings `sample_token` cannot use."""
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}.")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 (or None for no top-k filter), got {top_k!r}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None for no top-p filter), got {top_p}.")


def filter_logits(logits_BxV, *, top_k: int | None = None, top_p: float | None = None):
    """Logits with every token outside the top-k, then outside the top-p nucleus, at -inf.

    Top-p keeps the fewest most likely tokens whose probabilities sum to at least
    `top_p` (always at least the most likely one), as Hugging Face and Tunix do.
    """
    if top_k is not None and top_k < logits_BxV.shape[-1]:
        kth_B1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_B1, -jnp.inf, logits_BxV)
    if top_p is not None and top_p < 1:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        # a token stays if the tokens more likely than it sum to less than top_p
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
        kept_B = jnp.sum(before_BxV < top_p, axis=-1)
        cutoff_B1 = jnp.take_along_axis(sorted_BxV, kept_B[:, None] - 1, axis=-1)
        logits_BxV = jnp.where(logits_BxV < cutoff_B1, -jnp.inf, logits_BxV)
    return logits_BxV


def sample_token(logits_BxV, key, *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None):
    """One token per row [B]: argmax at temperature 0, else a draw from
    softmax(filter_logits(logits / temperature))."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1)
    scaled_BxV = logits_BxV.astype(jnp.float32) / temperature
    return jax.random.categorical(key, filter_logits(scaled_BxV, top_k=top_k, top_p=top_p), axis=-1)


def generate(graphdef, params, prompt_BxP, prompt_mask_BxP, key, *, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_id: int = 2, pad_id: int = 0, cache_size: int | None = None,
             prefill_logits: str = "all") -> Completions:
    """Sample `max_new_tokens` tokens after left-padded prompts, with a KV cache.

    Prompts are left-padded, as `data.prompt_arrays` makes them (every row's last prompt
    token in the last column). Each row stops at its first eos and emits `pad_id` after
    it. `temperature=0` is greedy decoding: exactly `model.greedy_generate`'s tokens.
    `key` is ignored then; otherwise it alone decides the draws. `key` is one key
    (`jax.random.key(0)`, or a raw `PRNGKey`), or one key per row: typed keys of shape
    [B] (or raw key data [B, 2]); then row i's token t is drawn with `fold_in(key[i], t)`,
    so a row's completion is the same whichever rows it is sampled with.

    `log_probs` are the policy's own: log_softmax of the raw logits (temperature 1, no
    top-k or top-p), the log-probs the training step computes for the same tokens (as
    TRL and Tunix report them). At temperature != 1, or with top-k/top-p, they are not
    the log-probs of the distribution the tokens were drawn from.

    `cache_size` (default P + max_new_tokens) is the cache's slots per row; it must hold
    the prompt and the new tokens.

    `prefill_logits="last"` computes the prefill's logits at the last prompt position
    only, the one sampled from: no [B, P, V] array (for a real vocabulary, gigabytes).
    "all", the default, projects every prompt position, as before: the last position's
    logits then round as they always did (a product of another shape can differ in the
    last bit, and the lessons' stored samples must not move).
    """
    if prefill_logits not in ("all", "last"):
        raise ValueError(f"prefill_logits must be 'all' or 'last', got {prefill_logits!r}.")
    check_sampling(temperature, top_k, top_p)
    if prompt_BxP.ndim != 2 or prompt_mask_BxP.shape != prompt_BxP.shape:
        raise ValueError(f"prompt must be [batch, length] with a mask of the same shape; got "
                         f"{prompt_BxP.shape} and {prompt_mask_BxP.shape}.")
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    _check_left_padded(prompt_mask_BxP)
    key = _row_keys_or_key(key, prompt_BxP.shape[0])
    P, T = prompt_BxP.shape[1], int(max_new_tokens)
    cache_size = P + T if cache_size is None else int(cache_size)
    if P + T > cache_size:
        raise ValueError(f"the prompt ({P} tokens) and max_new_tokens={T} need {P + T} cache slots, "
                         f"but cache_size={cache_size}; raise cache_size to {P + T} or shorten the prompt.")
    return _generate(graphdef, params, jnp.asarray(prompt_BxP), jnp.asarray(prompt_mask_BxP), key,
                     max_new_tokens=T, temperature=float(temperature),
                     top_k=None if top_k is None else int(top_k), top_p=None if top_p is None else float(top_p),
                     eos_id=eos_id, pad_id=pad_id, cache_size=cache_size, last_only=prefill_logits == "last")


def _row_keys_or_key(key, batch_size: int):
    """`key` as given when it is one key; typed keys [B] when it holds one key per row."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed and key.ndim == 2:  # raw key data, one [2] row per batch row
        key = jax.random.wrap_key_data(key)
        typed = True
    if typed and key.shape not in ((), (batch_size,)):
        raise ValueError(f"key has shape {key.shape}: pass one key (shape ()) or one key per row (shape "
                         f"({batch_size},)) for the {batch_size} prompts.")
    return key


def _check_left_padded(prompt_mask_BxP) -> None:
    """Decoding appends after the last column, so it must hold every row's last prompt token.

    Checked when the mask is concrete; under an outer jit (traced mask) it is the caller's
    promise.
    """
    if isinstance(prompt_mask_BxP, jax.core.Tracer):
        return
    last_B = np.asarray(prompt_mask_BxP)[:, -1]
    if not last_B.all():
        raise ValueError(f"prompts must be left-padded (the last column a real token in every row), as "
                         f"data.prompt_arrays makes them; rows {np.flatnonzero(last_B == 0)[:5].tolist()} end "
                         "in padding.")


# eos_id and pad_id are traced: changing them does not recompile.
@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p",
                                             "cache_size", "last_only"))
def _generate(graphdef, params, prompt_BxP, prompt_mask_BxP, key, *, max_new_tokens, temperature, top_k,
              top_p, eos_id, pad_id, cache_size, last_only=False) -> Completions:
    B, P = prompt_BxP.shape
    T = max_new_tokens
    cache = model_lib.init_cache(graphdef, params, B, cache_size)
    # prefill; with last_only the other positions, never sampled from, get no logits
    logits, cache = model_lib.extend(graphdef, params, prompt_BxP, prompt_mask_BxP, cache, 0, last_only=last_only)

    sample = functools.partial(sample_token, temperature=temperature, top_k=top_k, top_p=top_p)
    row_keys = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1

    def draw(t, logits_BxV):
        if not row_keys:  # one key for the batch
            return sample(logits_BxV, jax.random.fold_in(key, t))
        # one key per row: row i sees only its own logits and fold_in(key[i], t)
        return jax.vmap(lambda logits_V, k: sample(logits_V[None], jax.random.fold_in(k, t))[0])(logits_BxV, key)

    def pick(t, logits_BxV, done_B):
        """Token t of every row, its log-prob under the policy, and whether it counts."""
        token_B = draw(t, logits_BxV).astype(prompt_BxP.dtype)
        logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BxV, axis=-1), token_B[:, None], axis=-1)[:, 0]
        token_B = jnp.where(done_B, pad_id, token_B)
        return token_B, jnp.where(done_B, 0.0, logp_B), (~done_B).astype(jnp.int32)

    def write(out, t, token_B, logp_B, real_B):
        tokens, mask, logps = out
        return tokens.at[:, t].set(token_B), mask.at[:, t].set(real_B), logps.at[:, t].set(logp_B)

    out = (jnp.full((B, T), pad_id, prompt_BxP.dtype), jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T), jnp.float32))
    done_B = jnp.zeros((B,), bool)
    token_B, logp_B, real_B = pick(0, logits[:, -1], done_B)
    out = write(out, 0, token_B, logp_B, real_B)

    def step(t, carry):  # decode: feed token t-1 (at slot P + t - 1), pick token t
        cache, out, token_B, real_B, done_B = carry
        done_B = done_B | (token_B == eos_id)
        logits_Bx1xV, cache = model_lib.extend(graphdef, params, token_B[:, None], real_B[:, None], cache,
                                               P + t - 1)
        token_B, logp_B, real_B = pick(t, logits_Bx1xV[:, 0], done_B)
        return cache, write(out, t, token_B, logp_B, real_B), token_B, real_B, done_B

    _, out, _, _, _ = jax.lax.fori_loop(1, T, step, (cache, out, token_B, real_B, done_B))
    return Completions(*out)


# ------------------------------------------------------------------ on-policy sampling: prompts and keys

# What GRPO's rollouts (`tunix_nb.grpo`) and on-policy distillation's batches (`tunix_nb.gkd`)
# share: the prompt rows, one key per row from (seed, step, row), and a sampler that returns
# training rows, data-parallel under every strategy.


def prompt_rows(examples: Sequence[dict], tokenizer: Tokenizer | None = None,
                prompt_len: int = data.DEFAULT_PROMPT_LEN) -> dict[str, np.ndarray]:
    """The rows rollouts draw prompts from: left-padded `prompt_tokens_NxP`, `prompt_mask_NxP`,
    and `index_N` (the example each row is), for `data.batch_at(rows, step, B, seed=seed)`."""
    arrays = data.prompt_arrays([e["prompt"] for e in examples], tokenizer or ByteTokenizer(), prompt_len)
    return {"prompt_tokens": arrays["tokens"], "prompt_mask": arrays["attention_mask"],
            "index": np.arange(len(examples))}


def rollout_keys(seed: int, step: int, n_rows: int) -> np.ndarray:
    """Key data [n_rows, 2] (uint32): row r of step `step` samples with fold_in(fold_in(key(seed), step), r).

    One key per row of the global rollout batch, so a row's completion does not depend
    on which device samples it, nor on the other rows of its batch.
    """
    step_key = jax.random.fold_in(jax.random.key(seed), step)
    keys = jax.vmap(lambda r: jax.random.fold_in(step_key, r))(jnp.arange(n_rows))
    return np.asarray(jax.random.key_data(keys))


# ------------------------------------------------------------------ the training batch


def training_rows(prompt_BxP, prompt_mask_BxP, completion_BxT, completion_mask_BxT) -> dict:
    """Prompt + completion as one row, shifted for next-token prediction.

    `inputs`, `targets`, `attention_mask` are [B, P + T - 1]; `completion_mask` [B, T] is
    1 on the completion's tokens up to and including eos. The completion tokens are the
    last T targets, predicted by the last T positions.
    """
    seq_BxS = jnp.concatenate([prompt_BxP, completion_BxT.astype(prompt_BxP.dtype)], axis=1)
    mask_BxS = jnp.concatenate([prompt_mask_BxP, completion_mask_BxT.astype(prompt_mask_BxP.dtype)], axis=1)
    return {"inputs": seq_BxS[:, :-1], "targets": seq_BxS[:, 1:], "attention_mask": mask_BxS[:, :-1],
            "completion_mask": completion_mask_BxT.astype(jnp.int32)}


def completion_log_probs(graphdef, params, batch, *, with_entropy: bool = False, chunks=None):
    """Per-token log-probs [B, T] of the completion tokens, from one forward pass over
    prompt + completion; with `with_entropy`, also the policy's entropy [B, T] there.

    `chunks` (`vocab_chunks.Chunking`): logits only at the last T positions (TRL's
    `logits_to_keep`), in chunks; None: the full logits, then the last T (the reference)."""
    T = batch["completion_mask"].shape[1]
    if chunks is not None and not _one_chunk(graphdef, params, chunks):
        return _chunked_completion_log_probs(graphdef, params, batch, with_entropy, chunks)
    logits_BxTxV = model_lib.apply(graphdef, params, batch["inputs"], batch["attention_mask"])[:, -T:]
    logps_BxT = losses.token_log_probs(logits_BxTxV, batch["targets"][:, -T:])
    if not with_entropy:
        return logps_BxT
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return logps_BxT, -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)


def _one_chunk(graphdef, params, chunks):
    """Whether one chunk covers the vocabulary and the positions: then the chunked path is the
    reference's, which projects every position before slicing (a product of another shape
    rounds differently, and the toy presets must train bit for bit as before)."""
    return chunks.seq_chunk is None and model_lib.output_head(graphdef, params).weight_VxD.shape[0] <= chunks.vocab_chunk


def _chunked_completion_log_probs(graphdef, params, batch, with_entropy, chunks):
    T = batch["completion_mask"].shape[1]
    hidden_BxTxD = model_lib.hidden_states(graphdef, params, batch["inputs"], batch["attention_mask"])[:, -T:]
    args = (hidden_BxTxD, model_lib.output_head(graphdef, params), batch["targets"][:, -T:], batch["completion_mask"])
    if with_entropy:
        return vocab_chunks.log_probs_and_entropy(*args, chunks=chunks)
    return vocab_chunks.token_log_probs(*args, chunks=chunks)


# ------------------------------------------------------------------ sampling, per strategy


def make_sampler(graphdef, *, max_new_tokens: int = data.MAX_NEW_TOKENS, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, old_logps: bool = False,
                 ref_logps: bool = False, compute_dtype="auto", eos_id: int = 2, pad_id: int = 0,
                 parallel_mode: str = "jit", mesh=None, vocab_chunk: int | None = None,
                 seq_chunk: int | None = None) -> Callable:
    """`sample(params, reference, prompt_BxP, prompt_mask_BxP, key_data_Bx2) -> dict of host arrays`.

    Samples one completion per row (row i with its own key) and returns the training
    rows (`training_rows`), plus `old_logps` [B, T] (the sampling policy's, if asked)
    and `ref_logps` [B, T] (the reference's, if asked), computed by the same forward
    pass as the training step, in `compute_dtype`.

    `params` and `reference` lie as `parallel_mode` keeps the state (`train.run_on_policy`
    hands them over so): "jit" on one device; "pmap" replicated [n, ...], the rows split
    [n, B/n, ...], each device sampling its own; "shard_map", "dp" and "fsdp" the same
    per-device code under `jax.shard_map` on `mesh`, rows split P("data") (sampling needs
    no collective, so the three differ only in where the state lies: under fsdp the
    params are all-gathered before sampling). B must divide by the device count; the
    prompts arrive as host arrays, and the result returns as host arrays, the global batch.
    `vocab_chunk`/`seq_chunk`: the log-probs in chunks, as the objective's (`completion_log_probs`).
    """
    dtype = resolve_compute_dtype(compute_dtype)
    chunks = vocab_chunks.chunking(vocab_chunk, seq_chunk)
    check_sampling(temperature, top_k, top_p)
    decode = functools.partial(generate, graphdef, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id, pad_id=pad_id)

    def on_device(params, reference, prompt_BxP, prompt_mask_BxP, key_data_Bx2):
        policy = cast_floats(params, dtype)
        out = decode(policy, prompt_BxP, prompt_mask_BxP, jax.random.wrap_key_data(key_data_Bx2))
        rows = training_rows(prompt_BxP, prompt_mask_BxP, out.tokens, out.mask)
        if old_logps:
            rows["old_logps"] = completion_log_probs(graphdef, policy, rows, chunks=chunks)
        if ref_logps:
            rows["ref_logps"] = completion_log_probs(graphdef, cast_floats(reference, dtype), rows, chunks=chunks)
        return jax.tree.map(lax.stop_gradient, rows)

    if parallel_mode == "jit":
        fn = jax.jit(on_device)
    elif parallel_mode == "pmap":
        fn = jax.pmap(on_device, axis_name=parallel.DEVICE_AXIS)
    elif parallel_mode in parallel.MESH_MODES:
        # Sampling needs no communication: on every mesh strategy it is per-device code
        # (shard_map) on the device's rows, with whole params (fsdp's are all-gathered first).
        mesh = mesh or parallel.make_mesh()
        rows = P(parallel.MESH_AXIS)
        fn = jax.jit(jax.shard_map(on_device, mesh=mesh, in_specs=(P(), P(), rows, rows, rows), out_specs=rows,
                                   check_vma=False))
    else:
        raise ValueError(f"Unknown parallel mode {parallel_mode!r}; choose one of jit, pmap, "
                         f"{', '.join(parallel.MESH_MODES)}.")

    def sample(params, reference, prompt_BxP, prompt_mask_BxP, key_data_Bx2):
        inputs = (np.asarray(prompt_BxP), np.asarray(prompt_mask_BxP), np.asarray(key_data_Bx2))
        if parallel_mode == "pmap":
            inputs = parallel.shard_batch(inputs, jax.local_device_count())
        elif parallel_mode != "jit":
            inputs = parallel.place_batch(inputs, mesh)
        out = jax.device_get(fn(params, reference, *inputs))  # every array's copy started at once
        if parallel_mode == "pmap":  # [n, B/n, ...] -> [B, ...]
            out = {k: v.reshape(-1, *v.shape[2:]) for k, v in out.items()}
        return out

    return sample
