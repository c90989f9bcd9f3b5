"""The KV-cache sampler against the model it samples from: greedy tokens, log-probs, keys, filters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import checkpoint, data, losses, sampler
from tunix_nb import model as M
from tunix_nb.tokenizer import ByteTokenizer

NO_EOS = -1  # a token id no model emits: rows run to max_new_tokens


@pytest.fixture(scope="module", params=["tiny", "student"])
def preset_model(request):
    return M.split(M.make_model(request.param, seed=0))


@pytest.fixture(scope="module")
def tiny():
    return M.split(M.make_model("tiny", seed=0))


@pytest.fixture(scope="module")
def sft_student():
    graphdef, params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    return graphdef, params


def left_padded(rows, length):
    """Token lists -> (tokens [B, length], mask [B, length]), left-padded with 0."""
    tokens = np.zeros((len(rows), length), np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for i, row in enumerate(rows):
        tokens[i, length - len(row):], mask[i, length - len(row):] = row, 1
    return jnp.asarray(tokens), jnp.asarray(mask)


# prompts of different lengths, 1 to 9 real tokens in a 10-column buffer
PROMPTS = left_padded([[1, 40, 41, 42], [1, 50], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1]], 10)


def task_prompts(n=12):
    prompts = [e["prompt"] for e in data.load_sft()[:n]]
    arrays = data.prompt_arrays(prompts, ByteTokenizer(), data.DEFAULT_PROMPT_LEN)
    return jnp.asarray(arrays["tokens"]), jnp.asarray(arrays["attention_mask"])


def training_log_probs(graphdef, params, prompt_BxP, prompt_mask_BxP, out):
    """What a training step computes for the completions: one forward pass on prompt + completion."""
    tokens = jnp.concatenate([prompt_BxP, out.tokens], axis=1)
    mask = jnp.concatenate([prompt_mask_BxP, out.mask.astype(prompt_mask_BxP.dtype)], axis=1)
    P = prompt_BxP.shape[1]
    logits_BxLxV = M.apply(graphdef, params, tokens, mask)
    return losses.token_log_probs(logits_BxLxV[:, P - 1:-1], out.tokens)


def eos_from_greedy(graphdef, params, prompt, mask, steps):
    """An eos id that greedy decoding emits mid-way in row 0: rows then stop at different steps."""
    free = M.greedy_generate(graphdef, params, prompt, mask, max_new_tokens=steps, eos_id=NO_EOS)
    return int(free[0, steps // 2])


# ------------------------------------------------------------------ the model's cached path


def _pre_cache_forward(m, tokens_BxL, mask_BxL):
    """The full forward pass as model.py wrote it before the cache existed (a transcription)."""
    cfg = m.cfg
    real_BxL = mask_BxL.astype(bool)
    positions_BxL = jnp.maximum(jnp.cumsum(real_BxL, axis=-1) - 1, 0)
    L = tokens_BxL.shape[1]
    allowed_BxLxL = jnp.tril(jnp.ones((L, L), bool))[None] & real_BxL[:, None, :]
    x = m.embed(tokens_BxL)
    for block in m.blocks:
        a, h = block.attn, block.attn_norm(x)
        B, L, D = h.shape
        H = cfg.n_heads
        heads = lambda t: t.reshape(B, L, H, D // H)
        q = M.rope(heads(a.q(h)), positions_BxL, cfg.rope_base)
        k = M.rope(heads(a.k(h)), positions_BxL, cfg.rope_base)
        v = heads(a.v(h))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(D // H)
        scores = jnp.where(allowed_BxLxL[:, None], scores, -1e9)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        x = x + a.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, L, D))
        x = x + block.mlp(block.mlp_norm(x))
    return m.embed.attend(m.final_norm(x)).astype(jnp.float32)


@pytest.mark.parametrize("which", ["teacher", "sft_student", "tiny-bfloat16"])
def test_full_forward_is_bitwise_the_pre_cache_forward(which):
    """Sharing the attention math with the cached path left model.apply's logits bit for bit."""
    if which == "tiny-bfloat16":
        graphdef, params = M.split(M.make_model("tiny", seed=0, dtype="bfloat16"))
    else:
        graphdef, params, _ = checkpoint.load_model(data.DATA_DIR / which)
    tokens, mask = task_prompts(6)
    mask = mask.at[0, -3:].set(0)  # right padding in one row too
    now = jax.jit(M.apply, static_argnums=0)(graphdef, params, tokens, mask)
    before = jax.jit(lambda p, t, m: _pre_cache_forward(M.nnx.merge(graphdef, p), t, m))(params, tokens, mask)
    np.testing.assert_array_equal(now, before)


QWEN3_LIKE = dict(n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, tie_embeddings=False)


@pytest.mark.parametrize("options", [{}, QWEN3_LIKE, dict(n_kv_heads=1, qkv_bias=True)], ids=["tiny", "qwen3", "qwen2-mqa"])
def test_prefill_then_one_token_at_a_time_reproduces_the_full_forward(options):
    """Also with grouped-query attention (the cache holds only the key/value heads), q/k
    norms, biases, an explicit head_dim and an untied output layer."""
    graphdef, params = M.split(M.make_model("tiny", seed=0, **options))
    prompt, prompt_mask = PROMPTS
    new = jnp.array([[70, 71, 0], [72, 2, 0], [73, 74, 75], [76, 77, 78]], jnp.int32)
    new_mask = jnp.array([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]], jnp.int32)
    extend = jax.jit(M.extend, static_argnums=0)
    cache = M.init_cache(graphdef, params, 4, 16)
    prefill, cache = extend(graphdef, params, prompt, prompt_mask, cache, 0)
    steps = []
    for t in range(3):
        logits, cache = extend(graphdef, params, new[:, t:t + 1], new_mask[:, t:t + 1], cache, 10 + t)
        steps.append(logits)
    cached = jnp.concatenate([prefill, *steps], axis=1)
    full = M.apply(graphdef, params, jnp.concatenate([prompt, new], 1), jnp.concatenate([prompt_mask, new_mask], 1))
    real = np.asarray(jnp.concatenate([prompt_mask, new_mask], 1), bool)
    np.testing.assert_allclose(np.asarray(cached)[real], np.asarray(full)[real], atol=1e-5)


# ---------------------------------------------------------------------------- greedy


def test_temperature_zero_is_exactly_greedy_generate(preset_model):
    graphdef, params = preset_model
    prompt, mask = PROMPTS
    eos = eos_from_greedy(graphdef, params, prompt, mask, 8)
    want = M.greedy_generate(graphdef, params, prompt, mask, max_new_tokens=8, eos_id=eos)
    got = sampler.generate(graphdef, params, prompt, mask, jax.random.key(0), max_new_tokens=8,
                           temperature=0, eos_id=eos)
    assert (np.asarray(want) == eos).any(), "the test needs at least one eos stop"
    np.testing.assert_array_equal(got.tokens, want)


def test_temperature_zero_is_greedy_generate_on_the_trained_student(sft_student):
    """A trained model emits its own eos: rows stop at different lengths."""
    graphdef, params = sft_student
    prompt, mask = task_prompts(24)
    want = M.greedy_generate(graphdef, params, prompt, mask, max_new_tokens=data.MAX_NEW_TOKENS)
    got = sampler.generate(graphdef, params, prompt, mask, jax.random.key(0),
                           max_new_tokens=data.MAX_NEW_TOKENS, temperature=0)
    np.testing.assert_array_equal(got.tokens, want)
    assert len(set(np.asarray(got.mask).sum(1).tolist())) > 1


def test_top_k_one_and_tiny_top_p_are_greedy(tiny):
    graphdef, params = tiny
    prompt, mask = PROMPTS
    greedy = M.greedy_generate(graphdef, params, prompt, mask, max_new_tokens=8, eos_id=NO_EOS)
    for filters in ({"top_k": 1}, {"top_p": 1e-6}):
        got = sampler.generate(graphdef, params, prompt, mask, jax.random.key(3), max_new_tokens=8,
                               eos_id=NO_EOS, **filters)
        np.testing.assert_array_equal(got.tokens, greedy, err_msg=str(filters))


# ---------------------------------------------------------------- log-probs and eos


@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 1.0},
                                      {"temperature": 0.7, "top_k": 20, "top_p": 0.9}])
def test_log_probs_are_the_training_steps(sft_student, settings):
    """The sampler-vs-trainer mismatch: cached decoding against one full forward pass."""
    graphdef, params = sft_student
    prompt, mask = task_prompts(24)
    out = sampler.generate(graphdef, params, prompt, mask, jax.random.key(1),
                           max_new_tokens=data.MAX_NEW_TOKENS, **settings)
    trainer = training_log_probs(graphdef, params, prompt, mask, out)
    gap = float(np.max(np.abs(np.where(out.mask, trainer - out.log_probs, 0.0))))
    print(f"sampler vs trainer log-prob max |diff| {settings}: {gap:.2e}")
    assert gap <= 1e-5
    assert np.all(np.asarray(out.log_probs)[np.asarray(out.mask) == 0] == 0)


def test_log_probs_match_on_the_presets(preset_model):
    graphdef, params = preset_model
    prompt, mask = PROMPTS
    out = sampler.generate(graphdef, params, prompt, mask, jax.random.key(2), max_new_tokens=8, eos_id=NO_EOS)
    trainer = training_log_probs(graphdef, params, prompt, mask, out)
    gap = float(np.max(np.abs(trainer - out.log_probs)))
    print(f"sampler vs trainer log-prob max |diff|, random preset: {gap:.2e}")
    assert gap <= 1e-5


def test_rows_stop_at_eos_and_pad_after_it(tiny):
    graphdef, params = tiny
    prompt, mask = PROMPTS
    eos = eos_from_greedy(graphdef, params, prompt, mask, 8)
    out = sampler.generate(graphdef, params, prompt, mask, jax.random.key(0), max_new_tokens=8,
                           temperature=0, eos_id=eos, pad_id=7)
    tokens, completion_mask = np.asarray(out.tokens), np.asarray(out.mask)
    for row, row_mask in zip(tokens, completion_mask):
        stop = list(row).index(eos) + 1 if eos in row else len(row)
        assert row_mask.tolist() == [1] * stop + [0] * (len(row) - stop)
        assert (row[stop:] == 7).all()
    assert completion_mask.sum() < completion_mask.size  # some row stopped early


# ------------------------------------------------------------------- keys and filters


def test_a_rollout_is_a_pure_function_of_the_key(tiny):
    graphdef, params = tiny
    prompt, mask = PROMPTS
    draw = lambda seed: sampler.generate(graphdef, params, prompt, mask, jax.random.key(seed),
                                         max_new_tokens=8, eos_id=NO_EOS).tokens
    np.testing.assert_array_equal(draw(5), draw(5))
    assert not np.array_equal(draw(5), draw(6))


def test_one_compiled_program_serves_every_batch_of_a_shape(tiny):
    graphdef, params = tiny
    prompt, mask = PROMPTS
    run = lambda p, key: sampler.generate(graphdef, params, p, mask, key, max_new_tokens=8, eos_id=9)
    run(prompt, jax.random.key(0))
    compiled = sampler._generate._cache_size()
    run(prompt + 1, jax.random.key(1))
    assert sampler._generate._cache_size() == compiled


def test_a_larger_cache_changes_nothing(tiny):
    graphdef, params = tiny
    prompt, mask = PROMPTS
    draw = lambda **kw: sampler.generate(graphdef, params, prompt, mask, jax.random.key(4), max_new_tokens=8,
                                         eos_id=NO_EOS, **kw)
    exact, roomy = draw(), draw(cache_size=32)
    np.testing.assert_array_equal(exact.tokens, roomy.tokens)
    np.testing.assert_allclose(exact.log_probs, roomy.log_probs, atol=1e-6)


def chi_square(samples, probs):
    """Pearson's statistic and degrees of freedom, pooling the bins expected below 5 draws."""
    expected = probs * len(samples)
    observed = np.bincount(samples, minlength=len(probs))
    small = expected < 5
    e = np.append(expected[~small], expected[small].sum())
    o = np.append(observed[~small], observed[small].sum())
    keep = e > 0
    return float(np.sum((o[keep] - e[keep]) ** 2 / e[keep])), int(keep.sum()) - 1


def assert_drawn_from(samples, probs, others):
    """Samples fit probs (chi-square within 6 sigma of its mean) and clearly misfit each of others."""
    stat, df = chi_square(samples, probs)
    bound = df + 6 * np.sqrt(2 * df)
    assert stat < bound, (stat, bound)
    for other in others:
        assert chi_square(samples, other)[0] > 3 * bound


def test_temperature_scales_the_sampled_distribution():
    logits_V = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20_000
    dist = {t: np.asarray(jax.nn.softmax(logits_V / t)) for t in (0.5, 1.0, 2.0)}
    for t in dist:
        draws = sampler.sample_token(jnp.broadcast_to(logits_V, (n, 6)), jax.random.key(int(10 * t)), temperature=t)
        assert_drawn_from(np.asarray(draws), dist[t], [dist[o] for o in dist if o != t])


def test_first_sampled_token_follows_the_models_tempered_softmax(tiny):
    """End to end: many rows of one prompt, the first token's frequencies vs softmax(logits / T)."""
    graphdef, params = tiny
    n, prompt = 10_000, jnp.array([[1, 40, 41, 42, 43]], jnp.int32)
    logits_V = M.apply(graphdef, params, prompt)[0, -1]
    dist = {t: np.asarray(jax.nn.softmax(logits_V / t)) for t in (0.5, 2.0)}
    for t in dist:
        out = sampler.generate(graphdef, params, jnp.repeat(prompt, n, 0), jnp.ones((n, 5), jnp.int32),
                               jax.random.key(7), max_new_tokens=1, temperature=t, eos_id=NO_EOS)
        assert_drawn_from(np.asarray(out.tokens[:, 0]), dist[t], [dist[o] for o in dist if o != t])


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    probs_V = np.array([0.05, 0.5, 0.15, 0.3])
    logits_BxV = jnp.log(jnp.asarray(probs_V))[None]
    kept = lambda **kw: np.isfinite(np.asarray(sampler.filter_logits(logits_BxV, **kw)))[0].tolist()
    assert kept(top_k=2) == [False, True, False, True]
    assert kept(top_k=10) == [True] * 4
    # thresholds off the cumulative sums (0.5, 0.8, 0.95): a TPU's float32 exp and log are
    # some 50 eps off, so a threshold at a sum could fall either side of it there
    assert kept(top_p=0.49) == [False, True, False, False]  # 0.5 alone reaches 0.49
    assert kept(top_p=0.7) == [False, True, False, True]   # 0.5 + 0.3
    assert kept(top_p=0.81) == [False, True, True, True]
    assert kept(top_p=1.0) == [True] * 4
    assert kept(top_k=3, top_p=0.7) == [False, True, False, True]
    # the kept tokens are drawn in proportion to their probabilities
    draws = sampler.sample_token(jnp.broadcast_to(logits_BxV, (20_000, 4)), jax.random.key(0), top_p=0.7)
    assert_drawn_from(np.asarray(draws), np.array([0, 0.5, 0, 0.3]) / 0.8, [probs_V])


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": 0}, "top_k must be an integer >= 1"),
    ({"top_k": 2.5}, "top_k must be an integer >= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"cache_size": 12}, "need 14 cache slots, but cache_size=12; raise cache_size to 14"),
])
def test_bad_arguments_are_refused_with_the_fix(tiny, kwargs, message):
    graphdef, params = tiny
    prompt, mask = PROMPTS
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        sampler.generate(graphdef, params, prompt, mask, jax.random.key(0), **kwargs)


def test_mismatched_prompt_mask_is_refused(tiny):
    graphdef, params = tiny
    prompt, mask = PROMPTS
    with pytest.raises(ValueError, match="mask of the same shape"):
        sampler.generate(graphdef, params, prompt, mask[:, 1:], jax.random.key(0), max_new_tokens=4)


def test_right_padded_prompts_are_refused(tiny):
    graphdef, params = tiny
    prompt, mask = PROMPTS
    with pytest.raises(ValueError, match=r"must be left-padded .* rows \[1, 3\] end in padding"):
        sampler.generate(graphdef, params, prompt, mask.at[jnp.array([1, 3]), -1].set(0), jax.random.key(0),
                         max_new_tokens=4)


# ------------------------------------------------------------------------ one key per row


def test_one_key_per_row_makes_a_row_independent_of_its_batch(tiny):
    """Row i draws with its own key alone: 8 rows sampled at once equal the same rows
    sampled in two halves (how data-parallel rollouts split them over devices), and
    raw key data [B, 2] is the same keys."""
    graphdef, params = tiny
    prompt, mask = task_prompts(8)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(8))
    kwargs = dict(max_new_tokens=8, top_k=50, eos_id=NO_EOS)
    whole = sampler.generate(graphdef, params, prompt, mask, keys, **kwargs)
    halves = [sampler.generate(graphdef, params, prompt[s], mask[s], keys[s], **kwargs)
              for s in (slice(0, 4), slice(4, 8))]
    np.testing.assert_array_equal(whole.tokens, np.concatenate([h.tokens for h in halves]))
    np.testing.assert_allclose(whole.log_probs, np.concatenate([h.log_probs for h in halves]), atol=1e-6)
    raw = sampler.generate(graphdef, params, prompt, mask, jax.random.key_data(keys), **kwargs)
    np.testing.assert_array_equal(raw.tokens, whole.tokens)
    # the rows draw different tokens from one another, and from the one-key mode
    assert len({tuple(r) for r in np.asarray(whole.tokens).tolist()}) > 1
    one_key = sampler.generate(graphdef, params, prompt, mask, jax.random.key(7), **kwargs)
    assert not np.array_equal(one_key.tokens, whole.tokens)


def test_a_key_batch_of_the_wrong_size_is_refused(tiny):
    graphdef, params = tiny
    prompt, mask = PROMPTS
    keys = jax.random.split(jax.random.key(0), 3)
    with pytest.raises(ValueError, match=r"pass one key \(shape \(\)\) or one key per row \(shape \(4,\)\)"):
        sampler.generate(graphdef, params, prompt, mask, keys, max_new_tokens=4)
