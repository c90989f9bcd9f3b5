"""Chunked log-probs (tunix_nb.vocab_chunks) against the full-logits reference path.

- V = 1000 in chunks of 128, 8 positions per row per chunk: every objective's loss agrees
  to 1e-6 relative, its gradient to 2e-6 of the largest gradient entry (float32's floor:
  see the test).
- V = 259 (the toy presets) in one chunk: losses and gradients are bitwise the reference's.
- The compiled SFT step holds no float32 [B, L, V] array; the reference's does.
"""

import functools
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import distill, dpo, grpo, lora, losses, model, sampler, sft, vocab_chunks

B, L, V, T = 3, 21, 1000, 9
CHUNKS = dict(vocab_chunk=128, seq_chunk=8)


def rows(seed=0, vocab=V, starts=(3, 7, 12)):
    """Right-padded rows: completions start at a different position in each row."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    ends = jnp.array([[L - 2], [L], [L - 5]])
    start = jnp.array(starts)[:, None]
    position = jnp.arange(L)[None]
    return {"inputs": jax.random.randint(k1, (B, L), 1, vocab), "targets": jax.random.randint(k2, (B, L), 1, vocab),
            "attention_mask": (position < ends).astype(jnp.int32),
            "loss_mask": ((position >= start) & (position < ends)).astype(jnp.int32)}


def pair_batch(vocab=V):
    chosen, rejected = rows(1, vocab), rows(2, vocab, starts=(5, 3, 9))
    return {**{f"chosen_{k}": v for k, v in chosen.items()}, **{f"rejected_{k}": v for k, v in rejected.items()}}


def grpo_batch(vocab=V):
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    P = L - T + 1
    prompt_mask = (jnp.arange(P)[None] >= jnp.array([[0], [4], [2]])).astype(jnp.int32)
    completion_mask = (jnp.arange(T)[None] < jnp.array([[T], [4], [7]])).astype(jnp.int32)
    batch = grpo.training_rows(jax.random.randint(k1, (B, P), 1, vocab), prompt_mask,
                               jax.random.randint(k2, (B, T), 1, vocab), completion_mask)
    return {**batch, "advantages": jax.random.normal(k3, (B,)),
            "ref_logps": -jnp.abs(jax.random.normal(k3, (B, T)))}


def models(vocab, preset="tiny", tied=False):
    """(student, teacher) as (graphdef, params); the teacher's head is the tied embedding."""
    student = model.split(model.make_model(preset, vocab_size=vocab, tie_embeddings=tied))
    teacher = model.split(model.make_model(preset, seed=1, vocab_size=vocab, d_model=48, n_heads=2))
    return student, teacher


def objectives(student_graphdef, teacher_graphdef, names, **chunks):
    """The objectives `names` with the chunking keywords (none: the reference path)."""
    f32 = dict(compute_dtype=jnp.float32, **chunks)
    make = {
        "sft": lambda: sft.objective(student_graphdef, **f32),
        "kl": lambda: distill.objective(student_graphdef, teacher_graphdef, beta=0.0, **f32),
        "rkl": lambda: distill.objective(student_graphdef, teacher_graphdef, beta=1.0, temperature=1.5, **f32),
        "jsd": lambda: distill.objective(student_graphdef, teacher_graphdef, beta=0.3, alpha=0.7, **f32),
        "dpo": lambda: dpo.objective(student_graphdef, cached_reference=False, sft_weight=0.5, **f32),
        "grpo": lambda: grpo.objective(student_graphdef, **f32),
    }
    return {name: make[name]() for name in names}


def batches(vocab):
    sft_rows = rows(0, vocab)
    return {"sft": sft_rows, "kl": sft_rows, "rkl": sft_rows, "jsd": {**sft_rows, "own_sample": jnp.array([1., 0, 1])},
            "dpo": pair_batch(vocab), "grpo": grpo_batch(vocab)}


def total_loss(objective, params, batch, frozen):
    """The objective as the step reduces it: loss sums over weights, per term."""
    sums, weights, _ = objective(params, batch, frozen)
    if isinstance(sums, dict):
        return sum(sums[k] / weights[k] for k in sums)
    return sums / weights


def evaluate(vocab, preset, names, tied=False, **chunks):
    """{name: (loss, gradients)} of every objective in `names`, compiled as one program."""
    (sg, sp), (tg, tp) = models(vocab, preset, tied)
    frozen = {"kl": tp, "rkl": tp, "jsd": tp, "dpo": jax.tree.map(lambda x: x * 0.9, sp)}  # DPO's reference
    fns = objectives(sg, tg, names, **chunks)
    data = batches(vocab)

    @jax.jit
    def all_objectives(params, frozen):
        return {name: jax.value_and_grad(functools.partial(total_loss, fn))(params, data[name], frozen.get(name))
                for name, fn in fns.items()}

    return all_objectives(sp, frozen)


ALL = ("sft", "kl", "rkl", "jsd", "dpo", "grpo")


@pytest.fixture(scope="module")
def reference():
    return evaluate(V, "tiny", ALL)


@pytest.fixture(scope="module")
def chunked():
    return evaluate(V, "tiny", ALL, **CHUNKS)


@pytest.mark.parametrize("name", ["sft", "kl", "rkl", "jsd", "dpo", "grpo"])
def test_chunked_losses_and_gradients_agree_with_the_reference(reference, chunked, name):
    (loss_ref, grads_ref), (loss, grads) = reference[name], chunked[name]
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads_ref))
    assert largest > 0
    # 2e-6, not 1e-6: float32's own floor here. The reference's gradients differ from the
    # same computation in float64 by 0.8e-6 to 1.0e-6 of the largest entry (SFT, RKL, DPO,
    # GRPO), the chunked ones by 0.4e-6 to 1.15e-6: both are that far from exact, so they
    # can be up to twice that apart (measured: up to 1.2e-6, on the input embedding).
    for g_ref, g in zip(jax.tree.leaves(grads_ref), jax.tree.leaves(grads)):
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=2e-6 * largest)


def test_grpo_token_log_probs_agree_and_skip_no_completion_token():
    (graphdef, params), _ = models(V)
    batch = grpo_batch()
    ref = grpo.completion_log_probs(graphdef, params, batch, with_entropy=True)
    got = jax.jit(lambda p: grpo.completion_log_probs(graphdef, p, batch, with_entropy=True,
                                                      chunks=vocab_chunks.Chunking(128, 4)))(params)
    live = np.asarray(batch["completion_mask"]) != 0
    for r, g in zip(ref, got):
        np.testing.assert_allclose(np.asarray(g)[live], np.asarray(r)[live], rtol=1e-6)


@pytest.mark.parametrize("preset, names", [("tiny", ("sft", "kl", "jsd", "dpo", "grpo")), ("student", ("sft",))])
def test_one_vocabulary_chunk_is_bitwise_the_reference(preset, names):
    vocab = model.PRESETS[preset].vocab_size
    ref = evaluate(vocab, preset, names, tied=True)  # the presets as the lessons use them
    one_chunk = evaluate(vocab, preset, names, tied=True, vocab_chunk=vocab)
    for name in ref:
        (loss_ref, grads_ref), (loss, grads) = ref[name], one_chunk[name]
        assert jnp.array_equal(loss, loss_ref), name
        assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads_ref), jax.tree.leaves(grads))), name


def test_prefill_of_the_last_position_only():
    graphdef, params = model.split(model.make_model("student"))
    batch = rows(0, 259)
    cache = model.init_cache(graphdef, params, B, L + 4)
    full, _ = model.extend(graphdef, params, batch["inputs"], batch["attention_mask"], cache, 0)
    last, _ = model.extend(graphdef, params, batch["inputs"], batch["attention_mask"], cache, 0, last_only=True)
    assert last.shape == (B, 1, 259)
    np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=1e-5, atol=1e-6)
    prompt = jnp.ones((B, 5), jnp.int32)
    kwargs = dict(max_new_tokens=4, temperature=0.0)
    assert jnp.array_equal(sampler.generate(graphdef, params, prompt, prompt, jax.random.key(0), prefill_logits="last", **kwargs).tokens,
                           sampler.generate(graphdef, params, prompt, prompt, jax.random.key(0), **kwargs).tokens)
    with pytest.raises(ValueError, match="prefill_logits must be 'all' or 'last'"):
        sampler.generate(graphdef, params, prompt, prompt, jax.random.key(0), prefill_logits="first", **kwargs)


def f32_shapes(hlo_text):
    """Every float32 array shape in an HLO module's text, as tuples."""
    return {tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"f32\[([\d,]*)\]", hlo_text)}


def test_compiled_chunked_sft_step_has_no_full_logits():
    (graphdef, params), _ = models(V)
    batch = rows()

    def compiled_shapes(**chunks):
        objective = sft.objective(graphdef, compute_dtype=jnp.float32, **chunks)
        fn = jax.jit(jax.value_and_grad(lambda p: objective(p, batch)[0]))
        return f32_shapes(fn.lower(params).compile().as_text())

    too_big = [s for s in compiled_shapes(**CHUNKS) if np.prod(s) >= B * L * V]  # [B, L, V], [B * L, V], ...
    assert not too_big, too_big
    assert (B, L, V) in compiled_shapes()  # the reference path does build them


def head_products(jaxpr, size):
    """How many matrix products in `jaxpr` (scans' bodies included) give a chunk's logits [..., size]."""
    count = sum(eqn.outvars[0].aval.shape[-1:] == (size,) for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general")
    return count + sum(head_products(sub, size) for sub in jax.extend.core.subjaxprs(jaxpr))


def test_the_forward_pass_runs_the_head_once_per_chunk():
    """The online softmax: one pass over the vocabulary finds the max and the sum together (a
    max pass before the sum pass ran the head's product twice)."""
    hidden = jax.random.normal(jax.random.key(0), (2, 6, 32))
    head = model.OutputHead(None, jax.random.normal(jax.random.key(1), (V, 32)), None)
    targets = jnp.zeros((2, 6), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda h: vocab_chunks.sft_loss(h, head, targets, jnp.ones((2, 6)),
                                                          chunks=vocab_chunks.Chunking(100))[0])(hidden)
    assert head_products(jaxpr.jaxpr, 100) == 1


def test_online_softmax_where_the_max_rises_chunk_after_chunk():
    """Logits that grow along the vocabulary by hundreds (exp would overflow without the
    rescaling): each chunk raises the running max, and log-probs and gradients stay
    `jax.nn.log_softmax`'s."""
    D = 8
    hidden = jax.random.normal(jax.random.key(0), (2, 5, D))
    weight = jax.random.normal(jax.random.key(1), (V, D)) + (jnp.arange(V)[:, None] / 2.0)
    head = model.OutputHead(None, weight, None)
    targets = jax.random.randint(jax.random.key(2), (2, 5), 0, V)
    mask = jnp.ones((2, 5))

    def chunked(h):
        return vocab_chunks.token_log_probs(h, head, targets, mask, chunks=vocab_chunks.Chunking(64))

    def reference(h):
        return losses.token_log_probs(jnp.einsum("bld,vd->blv", h, weight), targets)

    with jax.default_matmul_precision("highest"):
        got, want = chunked(hidden), reference(hidden)
        assert np.all(np.isfinite(got)) and float(jnp.max(jnp.abs(want))) > 100
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(jax.grad(lambda h: chunked(h).sum())(hidden),
                                   jax.grad(lambda h: reference(h).sum())(hidden), rtol=1e-4, atol=1e-4)


def test_loss_positions_only_get_logits():
    (graphdef, params), _ = models(V)
    batch = rows()
    # 4 loss positions per row, at different places: gathered first, they fill one chunk of
    # 4, and the other 4 chunks of each row (prompt and padding) are skipped.
    loss_mask = (jnp.arange(L)[None] // 4 == jnp.array([[1], [3], [4]])).astype(jnp.int32)
    hidden = model.hidden_states(graphdef, params, batch["inputs"], batch["attention_mask"])
    head = model.output_head(graphdef, params)
    ref = np.asarray(losses.token_log_probs(head.project(hidden), batch["targets"]))
    live = np.asarray(loss_mask) != 0
    for vocab_chunk in (128, V):  # several vocabulary chunks, and one
        got = np.asarray(vocab_chunks.token_log_probs(hidden, head, batch["targets"], loss_mask,
                                                      chunks=vocab_chunks.Chunking(vocab_chunk, 4)))
        np.testing.assert_allclose(got[live], ref[live], rtol=1e-6)
        assert np.all(ref[~live] < 0) and np.all(got[~live] == 0)  # never computed there
    nll, count = vocab_chunks.sft_loss(hidden, head, batch["targets"], jnp.zeros((B, L)),
                                       chunks=vocab_chunks.Chunking(128, 4))
    assert float(nll) == 0.0 and float(count) == 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_chunk=0), "vocab_chunk must be a positive int"),
    (dict(vocab_chunk=-128), "vocab_chunk must be a positive int"),
    (dict(vocab_chunk=12.5), "vocab_chunk must be a positive int"),
    (dict(vocab_chunk=True), "vocab_chunk must be a positive int"),
    (dict(vocab_chunk=128, seq_chunk=0), "seq_chunk must be a positive int"),
    (dict(vocab_chunk=128, seq_chunk=-8), "seq_chunk must be a positive int"),
    (dict(seq_chunk=8), "seq_chunk=8 needs vocab_chunk"),
])
def test_bad_chunk_sizes_name_the_fix(kwargs, message):
    graphdef, _ = model.split(model.make_model("tiny"))
    with pytest.raises(ValueError, match=message):
        sft.objective(graphdef, **kwargs)
    with pytest.raises(ValueError, match=message):
        grpo.objective(graphdef, **kwargs)


def test_mismatched_shapes_name_both():
    (graphdef, params), (teacher_graphdef, teacher_params) = models(V)
    batch = rows()
    hidden = model.hidden_states(graphdef, params, batch["inputs"], batch["attention_mask"])
    head = model.output_head(graphdef, params)
    chunks = vocab_chunks.Chunking(128)
    with pytest.raises(ValueError, match=r"targets has shape \(3, 20\)"):
        vocab_chunks.token_log_probs(hidden, head, batch["targets"][:, 1:], batch["loss_mask"], chunks=chunks)
    other_graphdef, other_params = model.split(model.make_model("tiny", vocab_size=500))
    with pytest.raises(ValueError, match="vocabulary has 1000 entries but the teacher's 500"):
        vocab_chunks.distillation_loss(hidden, head, hidden, model.output_head(other_graphdef, other_params),
                                       batch["targets"], batch["loss_mask"], chunks=chunks)


def test_an_adapter_on_the_head_is_refused_and_lora_elsewhere_agrees():
    graphdef, params = model.split(model.make_model("tiny", vocab_size=300, tie_embeddings=False))
    batch = {k: v[:, :6] for k, v in rows(0, 300).items()}
    on_head = lora.apply(graphdef, params, rank=2, targets=r".*(lm_head|attn/q)")
    with pytest.raises(ValueError, match="leave the embedding and lm_head out of the LoRA targets"):
        lora.objective(sft.objective(on_head[0], vocab_chunk=128))(on_head[1], batch, lora.frozen(on_head[2]))
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=2)
    ref = lora.objective(sft.objective(lora_graphdef))(adapters, batch, lora.frozen(base))[0]
    got = lora.objective(sft.objective(lora_graphdef, vocab_chunk=128, seq_chunk=2))(adapters, batch, lora.frozen(base))[0]
    np.testing.assert_allclose(got, ref, rtol=1e-6)
