import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import compare
from tunix_nb import model as M


@pytest.fixture(scope="module")
def tiny():
    return M.split(M.make_model("tiny", seed=0))


def test_presets_grow_in_size():
    sizes = {name: M.count_params(M.split(M.make_model(name))[1]) for name in M.PRESETS}
    assert sizes["tiny"] < sizes["student"] < sizes["teacher"]
    assert sizes["teacher"] * 4 < 5_000_000  # a float32 teacher checkpoint fits in 5 MB


def test_logits_shape_and_dtype(tiny):
    graphdef, params = tiny
    logits = M.apply(graphdef, params, jnp.ones((3, 7), jnp.int32))
    assert logits.shape == (3, 7, 259) and logits.dtype == jnp.float32


def test_right_padding_does_not_change_real_logits(tiny):
    graphdef, params = tiny
    real = jnp.array([[1, 40, 41, 42, 43]])
    padded = jnp.array([[1, 40, 41, 42, 43, 0, 0, 0]])
    mask = jnp.array([[1, 1, 1, 1, 1, 0, 0, 0]])
    np.testing.assert_allclose(
        M.apply(graphdef, params, padded, mask)[:, :5], M.apply(graphdef, params, real), atol=1e-5
    )


def test_left_padding_does_not_change_real_logits(tiny):
    graphdef, params = tiny
    real = jnp.array([[1, 40, 41, 42, 43]])
    padded = jnp.array([[0, 0, 0, 1, 40, 41, 42, 43]])
    mask = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    np.testing.assert_allclose(
        M.apply(graphdef, params, padded, mask)[:, 3:], M.apply(graphdef, params, real), atol=1e-5
    )


def test_logits_are_causal(tiny):
    graphdef, params = tiny
    a = M.apply(graphdef, params, jnp.array([[1, 40, 41, 42]]))
    b = M.apply(graphdef, params, jnp.array([[1, 40, 41, 99]]))
    np.testing.assert_allclose(a[:, :3], b[:, :3], atol=1e-6)
    assert not np.allclose(a[:, 3], b[:, 3])


def test_fully_padded_row_stays_finite(tiny):
    graphdef, params = tiny
    logits = M.apply(graphdef, params, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))
    assert np.isfinite(np.asarray(logits)).all()


def test_bfloat16_compute_keeps_float32_params():
    graphdef, params = M.split(M.make_model("tiny", dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    logits = M.apply(graphdef, params, jnp.ones((2, 5), jnp.int32))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_params_cast_to_bfloat16_compute_in_bfloat16_from_the_embedding_on(tiny):
    """compute_dtype=None follows the params (what precision.cast_floats relies on): nnx.Embed
    fixes float32 when built, which would turn the whole pass back into float32."""
    from tunix_nb import precision

    graphdef, params = tiny
    in_bf16 = precision.cast_floats(params, jnp.bfloat16)
    tokens = jnp.ones((2, 5), jnp.int32)
    assert M.hidden_states(graphdef, in_bf16, tokens).dtype == jnp.bfloat16
    jaxpr = jax.make_jaxpr(lambda p: M.hidden_states(graphdef, p, tokens))(in_bf16)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    dots += [e for eqn in jaxpr.eqns for sub in jax.core.subjaxprs(eqn) for e in sub.eqns
             if e.primitive.name == "dot_general"] if hasattr(jax.core, "subjaxprs") else []
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def test_greedy_generate_matches_step_by_step_argmax(tiny):
    graphdef, params = tiny
    prompt = jnp.array([[0, 0, 1, 40, 41], [1, 50, 51, 52, 53]])
    mask = (prompt != 0).astype(jnp.int32).at[1, 0].set(1)
    new = M.greedy_generate(graphdef, params, prompt, mask, max_new_tokens=4)
    assert new.shape == (2, 4)
    for row in range(2):
        toks, msk = [int(t) for t in prompt[row]], [int(m) for m in mask[row]]
        for _ in range(4):
            logits = M.apply(graphdef, params, jnp.array([toks]), jnp.array([msk]))
            toks.append(int(jnp.argmax(logits[0, -1])))
            msk.append(1)
            if toks[-1] == 2:
                break
        expected = toks[prompt.shape[1]:]
        assert list(np.asarray(new[row][: len(expected)])) == expected


def test_greedy_generate_emits_pad_after_eos(tiny):
    graphdef, params = tiny
    # Make eos (id 2) the most likely next token everywhere by boosting its embedding row.
    params = jax.tree.map(lambda x: x, params)  # a copy: the fixture stays untouched
    embedding = params["embed"]["embedding"]
    embedding[...] = embedding[...].at[2].multiply(50.0)
    new = M.greedy_generate(graphdef, params, jnp.array([[1, 40, 41]]), jnp.ones((1, 3), jnp.int32),
                            max_new_tokens=3)
    first_eos = list(np.asarray(new[0])).index(2)
    assert (np.asarray(new[0, first_eos + 1:]) == 0).all()


def test_bad_configs_raise_clear_errors():
    with pytest.raises(ValueError, match="Unknown model preset 'huge'"):
        M.make_model("huge")
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        M.get_config("student", d_model=30)
    M.get_config("student", d_model=30, head_dim=8)  # an explicit head_dim need not divide d_model
    with pytest.raises(ValueError, match="n_heads=4 is not a multiple of n_kv_heads=3"):
        M.get_config("student", n_kv_heads=3)
    with pytest.raises(ValueError, match="RoPE needs an even head size, got 7"):
        M.get_config("student", head_dim=7)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length\]"):
        M.make_model("tiny")(jnp.ones((5,), jnp.int32))


def llama3_inv_freq_transcribed(head_dim, theta, factor, low, high, original):
    """Meta's reference (llama-models `apply_scaling`), transcribed element by element."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(freq)
        elif wavelen > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_llama3_rope_scaling_matches_a_transcription_of_the_reference():
    """Llama 3.1's own settings (head_dim 128, theta 500000): all three bands occur."""
    s = M.Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
    half = 64
    inv_freq = 500000.0 ** (-np.arange(half, dtype=np.float32) / half)
    got = np.asarray(M.llama3_frequencies(jnp.asarray(inv_freq), s))
    want = llama3_inv_freq_transcribed(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    wavelen = 2 * np.pi / want
    assert (wavelen < 2048).any() and (wavelen > 8192).any() and ((wavelen >= 2048) & (wavelen <= 8192)).any()


def test_grouped_query_attention_equals_repeating_the_key_value_heads():
    """A GQA model is the multi-head model whose k/v projections repeat each head's columns."""
    gqa = M.make_model("tiny", seed=1, n_heads=4, n_kv_heads=2, head_dim=8)
    mha = M.make_model("tiny", seed=1, n_heads=4, head_dim=8)
    for g_block, m_block in zip(gqa.blocks, mha.blocks):
        for name in ("k", "v"):
            kernel = getattr(g_block.attn, name).kernel[...].reshape(32, 2, 8)
            getattr(m_block.attn, name).kernel[...] = jnp.repeat(kernel, 2, axis=1).reshape(32, 32)
        for name in ("q", "out"):
            getattr(m_block.attn, name).kernel[...] = getattr(g_block.attn, name).kernel[...]
    tokens = jnp.array([[1, 40, 41, 42, 43, 44]])
    np.testing.assert_allclose(gqa(tokens), mha(tokens), atol=1e-5)


def test_an_eager_forward_pass_is_one_program_and_a_traced_one_joins_its_caller(tiny):
    """Outside a trace, `apply` and `hidden_states` lower one program per shape instead of one
    per operation (on a TPU each lowering costs a compile); inside a jitted function they
    add nothing of their own: the caller's program is the only one."""
    from jax import monitoring

    lowered = []

    def on_event(event, seconds, **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    monitoring.register_event_duration_secs_listener(on_event)
    try:
        check_one_program_each(tiny, lowered)
    finally:
        monitoring.unregister_event_duration_listener(on_event)


def check_one_program_each(tiny, lowered):
    graphdef, params = tiny
    tokens_BxL = jnp.arange(3 * 11, dtype=jnp.int32).reshape(3, 11) % 200 + 3  # shapes no other test uses
    for forward in (M.apply, M.hidden_states):
        lowered.clear()
        eager = forward(graphdef, params, tokens_BxL)
        assert len(lowered) == 1, f"{forward.__name__}: {len(lowered)} programs"
        lowered.clear()
        traced = jax.jit(lambda p, t: forward(graphdef, p, t) * 1.0)(params, tokens_BxL)
        assert len(lowered) == 1
        np.testing.assert_array_equal(traced, eager)
    # the same pass, one operation at a time (how it ran before): the same logits to float32 rounding
    with jax.disable_jit():
        one_at_a_time = M.apply(graphdef, params, tokens_BxL)
    np.testing.assert_allclose(one_at_a_time, M.apply(graphdef, params, tokens_BxL), rtol=0, atol=1e-5)


def test_scanned_blocks_compute_the_unrolled_models_logits_and_gradients_bit_for_bit():
    """`scan_layers` runs the same blocks as one jax.lax.scan over their stacked parameters:
    the same parameter tree (names, shapes), the same logits and gradients, with remat too,
    and with LoRA adapters from qwix on every block."""
    from tunix_nb import lora

    config = M.get_config("tiny", n_layers=3)
    graphdef, params = M.split(M.make_model(config, seed=0))
    scanned, scanned_params = M.split(M.make_model(M.get_config(config, scan_layers=True), seed=0))
    assert jax.tree.structure(scanned_params) == jax.tree.structure(params)
    tokens_BxL = jnp.arange(2 * 9, dtype=jnp.int32).reshape(2, 9) % 200 + 3
    np.testing.assert_array_equal(M.apply(scanned, params, tokens_BxL), M.apply(graphdef, params, tokens_BxL))

    def gradients(graphdef):
        return jax.jit(jax.grad(lambda p: M.apply(graphdef, p, tokens_BxL).std()))(params)

    unrolled = gradients(graphdef)
    for variant in (scanned, M.with_remat(scanned, params)):
        for a, b in zip(jax.tree.leaves(gradients(variant)), jax.tree.leaves(unrolled)):
            np.testing.assert_array_equal(a, b)
    hlo = jax.jit(lambda p: M.apply(scanned, p, tokens_BxL)).lower(params).as_text()
    assert hlo.count("stablehlo.while") == 1  # one loop over the layers, not three copies of a block
    adapted = {}
    for name, variant in (("unrolled", graphdef), ("scanned", scanned)):
        lora_graphdef, adapters, base = lora.apply(variant, params, rank=4)
        nudged = jax.tree.map(lambda a: a + 0.01, adapters)  # fresh adapters compute nothing: move them
        adapted[name] = M.apply(lora_graphdef, lora.combine(nudged, base), tokens_BxL)
        if name == "scanned":  # qwix's per-block module names do not keep the blocks out of one scan
            hlo = jax.jit(lambda a: M.apply(lora_graphdef, lora.combine(a, base), tokens_BxL)).lower(nudged).as_text()
            assert hlo.count("stablehlo.while") == 1
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(adapted["scanned"], adapted["unrolled"])
    else:  # a TPU fused the adapted blocks otherwise in the loop: 7.5e-07 apart there (share s11)
        bound = compare.float32_bound(compare.forward_pass_terms(config, 9) + 4) * float(jnp.abs(adapted["unrolled"]).max())
        assert compare.max_abs_diff(adapted["scanned"], adapted["unrolled"]) <= bound
    assert float(jnp.abs(adapted["unrolled"] - M.apply(graphdef, params, tokens_BxL)).max()) > 1e-3
