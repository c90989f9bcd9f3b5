import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length\]"):
        M.make_model("tiny")(jnp.ones((5,), jnp.int32))
