"""LoRA and QLoRA through qwix: the formula, the frozen base, every step builder, the merge."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import compare, data, hf, lora, model, train
from tunix_nb import sft as sft_method
from tunix_nb.tokenizer import ByteTokenizer

TOKENS = jnp.asarray(np.arange(3, 27).reshape(2, 12), jnp.int32)
QWEN3 = Path(__file__).parent / "fixtures" / "hf" / "qwen3"


@pytest.fixture(scope="module")
def tiny():
    return model.split(model.make_model("tiny", seed=0))


def nudged(adapters, scale=0.05):
    """Adapters moved away from B = 0, as training would."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_one_adapted_layer_computes_x_w_plus_alpha_over_rank_x_a_b(tiny):
    """Only layer 0's q adapter nudged: the model equals the plain one whose q kernel is
    W + (alpha / rank) A B, written out by hand."""
    graphdef, params = tiny
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=8.0)
    pure = model.nnx.to_pure_dict(adapters)
    q = pure["blocks"][0]["attn"]["q"]
    a = jax.random.normal(jax.random.key(0), q["kernel_lora_a"].shape)
    b = jax.random.normal(jax.random.key(1), q["kernel_lora_b"].shape)
    assert a.shape == (32, 4) and b.shape == (4, 32)
    q["kernel_lora_a"], q["kernel_lora_b"] = a, b
    model.nnx.replace_by_pure_dict(adapters, pure)
    by_hand = model.nnx.to_pure_dict(params)
    by_hand["blocks"][0]["attn"]["q"]["kernel"] = by_hand["blocks"][0]["attn"]["q"]["kernel"] + (8.0 / 4) * (a @ b)
    plain = jax.tree.map(lambda x: x, params)
    model.nnx.replace_by_pure_dict(plain, by_hand)
    np.testing.assert_allclose(model.apply(lora_graphdef, lora.combine(adapters, base), TOKENS),
                               model.apply(graphdef, plain, TOKENS), atol=1e-4)


@pytest.mark.parametrize("quantize", lora.QUANTIZE)
def test_adapters_start_at_the_base_and_switched_off_give_it_exactly(tiny, quantize):
    graphdef, params = tiny
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=8.0, quantize=quantize)
    start = model.apply(lora_graphdef, lora.combine(adapters, base), TOKENS)
    off = model.apply(lora_graphdef, lora.combine(lora.switched_off(nudged(adapters)), base), TOKENS)
    assert np.array_equal(start, off)  # B = 0 at the start: the (quantised) base model
    if quantize == "none":
        assert np.array_equal(start, model.apply(graphdef, params, TOKENS))
    assert all(isinstance(v, model.nnx.LoRAParam) for v in jax.tree.leaves(adapters, is_leaf=lambda x: isinstance(x, model.nnx.Variable)))


@pytest.mark.parametrize("quantize", lora.QUANTIZE)
def test_merged_export_computes_what_the_adapted_model_computes(tiny, quantize, tmp_path):
    graphdef, params = tiny
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=8.0, quantize=quantize)
    adapters = nudged(adapters)
    adapted = model.apply(lora_graphdef, lora.combine(adapters, base), TOKENS)
    plain_graphdef, merged = lora.merge(lora_graphdef, adapters, base, alpha=8.0)
    assert plain_graphdef == graphdef
    np.testing.assert_allclose(model.apply(plain_graphdef, merged, TOKENS), adapted, atol=1e-5)
    assert np.abs(adapted - model.apply(graphdef, params, TOKENS)).max() > 0.1  # the adapters do something
    out = hf.save_pretrained(tmp_path, plain_graphdef, merged, model.get_config("tiny"))
    g2, p2, _ = hf.load_pretrained(out)
    assert compare.bitwise_equal(p2, merged)


def test_merge_multiplies_the_adapters_at_float32_precision_on_any_backend(tiny, monkeypatch):
    """A TPU multiplies float32 matrices in one bfloat16 pass by default, so A B must ask for
    'highest' itself: else the export differs from base + adapters by bfloat16 rounding
    (lesson 12 failed so on a TPU v5e). A CPU computes both ways alike, so the call is checked."""
    graphdef, params = tiny
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=8.0)
    precisions, matmul = [], jnp.matmul
    monkeypatch.setattr(jnp, "matmul", lambda *a, **k: precisions.append(k.get("precision")) or matmul(*a, **k))
    with jax.default_matmul_precision("bfloat16"):
        lora.merge(lora_graphdef, nudged(adapters), base, alpha=8.0)
    adapted_kernels = len(jax.tree.leaves(adapters)) // 2
    assert precisions == [jax.lax.Precision.HIGHEST] * adapted_kernels


def test_qlora_on_a_loaded_checkpoint_quantises_the_base_and_keeps_adapters_float32():
    graphdef, params, _ = hf.load_pretrained(QWEN3)
    with pytest.raises(ValueError, match="tile_size=32: a kernel's input size does not divide by it"):
        lora.apply(graphdef, params, rank=2, alpha=4.0, quantize="nf4")  # the MLP's 48 inputs
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=2, alpha=4.0, quantize="nf4", tile_size=16)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(base)}
    assert "uint4" in dtypes and {str(x.dtype) for x in jax.tree.leaves(adapters)} == {"float32"}
    assert lora.count(adapters) < model.count_params(params) // 5
    logits = model.apply(lora_graphdef, lora.combine(adapters, base), TOKENS)
    assert np.isfinite(np.asarray(logits)).all()


# ----------------------------------------------------------------- training


@pytest.fixture(scope="module")
def lora_sft(tiny):
    graphdef, params = tiny
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=8.0)
    rows = data.sft_arrays(data.load_sft()[:128], ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    opt = train.make_optimizer(train.OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=8))
    objective = lora.objective(sft_method.objective(lora_graphdef, compute_dtype=None))
    return {"params": params, "adapters": adapters, "base": base, "opt": opt, "objective": objective,
            "batch_fn": lambda s: data.uneven_batch(rows, s, 8)}


def run_lora(lora_sft, mode, steps=6):
    s = lora_sft
    step = train.make_step(s["objective"], s["opt"], parallel_mode=mode)
    return train.run(step, s["adapters"], s["opt"].init(s["adapters"]), s["batch_fn"], steps=steps,
                     parallel_mode=mode, frozen=lora.frozen(s["base"]), progress=False)


@pytest.fixture(scope="module")
def lora_jit(lora_sft):
    return run_lora(lora_sft, "jit")


def test_training_moves_only_the_adapters_and_the_optimizer_state_is_theirs(lora_sft, lora_jit):
    adapters, opt_state, history = lora_jit
    assert history[-1]["loss"] < history[0]["loss"]
    assert compare.max_abs_diff(adapters, lora_sft["adapters"]) > 0
    adam_moments = [x for x in jax.tree.leaves(opt_state) if x.ndim > 0]
    assert sum(x.size for x in adam_moments) == 2 * lora.count(lora_sft["adapters"])
    # the base is never touched: bitwise the weights it was split from
    assert compare.bitwise_equal(lora_sft["base"], lora.apply(*model.split(model.make_model("tiny", seed=0)),
                                                              rank=4, alpha=8.0)[2])


# float32's bound for gradients that add the batch's 32 rows x 24 positions, with 5x for
# AdamW, which divides each entry by its own RMS where the adapters' gradients are near
# zero (B starts at 0). Measured: 1e-5 to 3e-5 of the distance travelled, depending on the
# processor; per-device means land over 100x the bound away.
LORA_BOUND = compare.float32_bound(32 * data.DEFAULT_SEQ_LEN, amplification=5)


@pytest.mark.parametrize("mode", ["pmap", "shard_map", "dp", "fsdp"])
def test_adapter_training_under_every_strategy_matches_jit(lora_sft, lora_jit, mode):
    """pmap, shard_map and dp replicate the adapters and the base; fsdp splits both (the
    base in `frozen`), and the step gathers them whole."""
    adapters, _, _ = run_lora(lora_sft, mode)
    assert compare.relative_distance(adapters, lora_jit[0], lora_sft["adapters"]) <= LORA_BOUND


@pytest.mark.needs_devices(8)
def test_the_bound_fails_per_device_means_by_100x(lora_sft, lora_jit):
    def mean_per_device(params, batch, frozen):
        loss_sum, weight, metrics = lora_sft["objective"](params, batch, frozen)
        return loss_sum / weight, 1.0, metrics

    wrong, _, _ = run_lora(dict(lora_sft, objective=mean_per_device), "pmap")
    assert compare.relative_distance(wrong, lora_jit[0], lora_sft["adapters"]) >= 100 * LORA_BOUND


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0}, "rank must be a positive int"),
    ({"alpha": 0.0}, "alpha must be positive"),
    ({"quantize": "fp4"}, "quantize='fp4'; choose one of"),
    ({"targets": r".*nothing_here"}, "matched no layer"),
])
def test_bad_settings_are_refused_with_the_fix(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        lora.apply(*tiny, **{"rank": 4, "alpha": 8.0, **kwargs})


def test_the_objective_needs_the_base_in_frozen(lora_sft):
    with pytest.raises(ValueError, match="frozen=lora.frozen"):
        lora_sft["objective"](lora_sft["adapters"], lora_sft["batch_fn"](0), None)


def test_adapters_stay_float32_on_a_bfloat16_base(tmp_path):
    """--dtype bfloat16 keeps the frozen base in bfloat16; the adapters train in float32,
    and the merged export is written in the base's dtype."""
    graphdef, params, _ = hf.load_pretrained(QWEN3, dtype="bfloat16")
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=2, alpha=4.0)
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype("bfloat16")}
    out = hf.save_merged(tmp_path, lora_graphdef, nudged(adapters), base, alpha=4.0)
    _, reloaded, _ = hf.load_pretrained(out)
    assert {x.dtype for x in jax.tree.leaves(reloaded)} == {jnp.dtype("bfloat16")}


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_every_entry_into_the_model_runs_the_adapters(tiny, quantize):
    """qwix intercepts `__call__` only: the hidden states (vocab_chunks' path) and the cached
    pass (the sampler's) enter through it too, so they compute the adapted model, not the base."""
    graphdef, params = tiny
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=8.0, quantize=quantize)
    adapted = lora.combine(nudged(adapters), base)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 200 + 3
    logits = model.apply(lora_graphdef, adapted, tokens)
    base_logits = model.apply(lora_graphdef, lora.combine(adapters, base), tokens)
    assert float(jnp.abs(logits - base_logits).max()) > 0.1  # the adapters change the model
    # one compiled program each, as model.apply runs eagerly: the same arithmetic, the same bits
    projected = jax.jit(lambda p: model.output_head(lora_graphdef, p).project(
        model.hidden_states(lora_graphdef, p, tokens)))(adapted)
    np.testing.assert_array_equal(projected, logits)
    cache = model.init_cache(lora_graphdef, adapted, 2, 8)
    cached, _ = model.extend(lora_graphdef, adapted, tokens, jnp.ones_like(tokens), cache, 0)
    np.testing.assert_allclose(cached, logits, atol=1e-5)


def test_chunked_sft_gradients_reach_the_adapters(tiny):
    graphdef, params = tiny
    lora_graphdef, adapters, base = lora.apply(graphdef, params, rank=4, alpha=8.0)
    batch = data.batch_at(data.sft_arrays(data.load_sft()[:16], ByteTokenizer(), data.DEFAULT_SEQ_LEN), 0, 8, seed=0)
    grads = [jax.grad(lambda a: (lambda s, n, _: s / n)(*lora.objective(sft_method.objective(
        lora_graphdef, compute_dtype=jnp.float32, vocab_chunk=chunk))(a, batch, lora.frozen(base))))(adapters)
        for chunk in (None, 64)]
    largest = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads[0]))
    assert largest > 0
    for full, chunked in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(chunked, full, rtol=0, atol=2e-6 * largest)  # vocab_chunks' gradient bound
