"""Lesson 10's NF4 by hand (notebooks/10_lora_qlora.ipynb, "QLoRA: a 4-bit base"): the 16
levels, per-block absmax scales, nearest-level codes and the dequantised weights equal what
qwix stores for the kit's QLoRA base, and the true bytes per weight.

The hand-written functions mirror the lesson's cells (a notebook is not importable).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from qwix._src.core import numerics
from scipy.stats import norm

from tunix_nb import checkpoint, data, lora

EPS = np.finfo(np.float32).eps
DELTA = 0.9677083  # bitsandbytes' create_normal_map: the outermost probability


def nf4_levels(delta: float = DELTA) -> np.ndarray:
    """The 16 NF4 levels: quantiles of N(0, 1), 8 above the median and 7 below, plus 0,
    normalised to [-1, 1] (Dettmers et al., 2023, appendix E)."""
    above = norm.ppf(np.linspace(delta, 0.5, 9)[:-1])
    below = -norm.ppf(np.linspace(delta, 0.5, 8)[:-1])
    levels = np.sort(np.concatenate([below, [0.0], above]))
    return (levels / levels.max()).astype(np.float32)


def nf4_by_hand(W_in_out: np.ndarray, levels: np.ndarray, block: int = lora.DEFAULT_TILE_SIZE):
    """(codes [in, out], scales [in / block, out], dequantised [in, out]): blocks of `block`
    consecutive input rows of one output column, each scaled by its absmax."""
    blocks_NxBxOut = W_in_out.reshape(-1, block, W_in_out.shape[1])
    scales_NxOut = np.abs(blocks_NxBxOut).max(axis=1)
    scaled = blocks_NxBxOut / scales_NxOut[:, None, :]
    codes_NxBxOut = np.abs(scaled[..., None] - levels).argmin(-1).astype(np.uint8)
    dequantised = levels[codes_NxBxOut] * scales_NxOut[:, None, :]
    return codes_NxBxOut.reshape(W_in_out.shape), scales_NxOut, dequantised.reshape(W_in_out.shape)


def bits_per_weight(block_size: int, scale_dtype, code_bits: int = 4) -> float:
    """A 4-bit code plus its share of the block's scale."""
    return code_bits + 8 * jnp.dtype(scale_dtype).itemsize / block_size


@pytest.fixture(scope="module")
def student_and_qlora_base():
    graphdef, params, _ = checkpoint.load_model(data.DATA_DIR / "sft_student")
    _, _, base = lora.apply(graphdef, params, rank=4, quantize="nf4")
    return params, base


def adapted_kernels(params, quantised_base):
    """(path, float32 kernel, qwix's QArray fields) for every adapted layer."""
    float_blocks = nnx.to_pure_dict(params)["blocks"]
    out = []
    for b, block in nnx.to_pure_dict(quantised_base)["blocks"].items():
        for group in ("attn", "mlp"):
            for name, layer in block[group].items():
                out.append((f"blocks/{b}/{group}/{name}", np.asarray(float_blocks[b][group][name]["kernel"]),
                            layer["kernel"]["array"]))
    return out


def test_levels_are_sorted_symmetric_at_the_ends_and_include_zero():
    levels = nf4_levels()
    assert levels.shape == (16,) and levels.dtype == np.float32
    assert np.all(np.diff(levels) > 0)
    assert levels[0] == -1.0 and levels[-1] == 1.0
    assert 0.0 in levels
    assert (levels > 0).sum() == 8 and (levels < 0).sum() == 7  # the extra positive level keeps 0 exact


def test_levels_match_qwix_table_within_two_float32_steps():
    qwix_levels = np.asarray(numerics.get_nf4_buckets())
    assert np.abs(nf4_levels() - qwix_levels).max() <= 2 * EPS
    # ...and a wrong construction (symmetric, 8 and 8 quantiles, no zero) does not
    above = norm.ppf(np.linspace(DELTA, 0.5, 9)[:-1])
    symmetric = np.sort(np.concatenate([-above, above]))
    assert np.abs(symmetric / symmetric.max() - qwix_levels).max() > 0.01


def test_hand_nf4_codes_scales_and_dequantised_equal_qwix_on_every_adapted_kernel(student_and_qlora_base):
    params, base = student_and_qlora_base
    kernels = adapted_kernels(params, base)
    assert len(kernels) == 14  # q, k, v, out, gate, up, down in 2 layers
    levels, qwix_levels = nf4_levels(), np.asarray(numerics.get_nf4_buckets())
    for path, W, q in kernels:
        assert q["qvalue"].dtype == jnp.uint4 and q["scale"].dtype == jnp.float32, path
        qwix_dequantised = np.asarray(qwix.dequantize(qwix.QArray(q["qvalue"], q["scale"], qtype="nf4")))
        codes, scales, dequantised = nf4_by_hand(W, levels)
        assert np.array_equal(codes, np.asarray(q["qvalue"]).astype(np.uint8)), path
        assert np.array_equal(scales, np.asarray(q["scale"])), path
        bound = np.repeat(3 * EPS * scales, lora.DEFAULT_TILE_SIZE, axis=0)  # the levels' 2 steps, one rounding
        assert np.all(np.abs(dequantised - qwix_dequantised) <= bound), path
        # with qwix's own table the dequantised weights are bitwise qwix's
        assert np.array_equal(nf4_by_hand(W, qwix_levels)[2], qwix_dequantised), path


def test_blocks_along_the_output_axis_would_not_match(student_and_qlora_base):
    """The check can fail: tiling the other axis gives other scales and codes."""
    params, base = student_and_qlora_base
    _, W, q = adapted_kernels(params, base)[0]
    codes_T, scales_T, _ = nf4_by_hand(W.T.copy(), nf4_levels())
    assert scales_T.shape != np.asarray(q["scale"]).shape or not np.array_equal(scales_T, np.asarray(q["scale"]))
    assert not np.array_equal(codes_T.T, np.asarray(q["qvalue"]).astype(np.uint8))


def test_hand_nf4_error_is_larger_than_int8_with_the_same_blocks(student_and_qlora_base):
    params, base = student_and_qlora_base
    err_nf4 = err_int8 = norm2 = 0.0
    for _, W, _ in adapted_kernels(params, base):
        W_int8 = qwix.dequantize(qwix.quantize(jnp.asarray(W), jnp.int8, channelwise_axes=[1],
                                               tiled_axes={0: lora.DEFAULT_TILE_SIZE}))
        err_nf4 += float(np.sum((nf4_by_hand(W, nf4_levels())[2] - W).astype(np.float64) ** 2))
        err_int8 += float(np.sum((np.asarray(W_int8) - W).astype(np.float64) ** 2))
        norm2 += float(np.sum(W.astype(np.float64) ** 2))
    rel_nf4, rel_int8 = (err_nf4 / norm2) ** 0.5, (err_int8 / norm2) ** 0.5
    assert 0 < rel_int8 < 0.01 < rel_nf4 < 0.15  # the lesson prints 0.5% and 8.7%
    assert round(rel_nf4, 3) == 0.087 and round(rel_int8, 3) == 0.005


@pytest.mark.parametrize("block_size, bits", [(32, 4 + 32 / 32), (64, 4 + 32 / 64)])
def test_bits_per_weight_with_float32_scales_is_the_closed_form(block_size, bits):
    assert bits_per_weight(block_size, jnp.float32) == bits
    assert 32 / bits_per_weight(block_size, jnp.float32) == pytest.approx(32 * block_size / (4 * block_size + 32))


def test_bits_per_weight_figures_the_lesson_quotes():
    assert bits_per_weight(32, jnp.float32) == 5.0 and 32 / 5.0 == 6.4 and 16 / 5.0 == 3.2
    assert bits_per_weight(64, jnp.bfloat16) == 4.25
    # QLoRA's double quantisation: int8 scales per 64, a float32 scale per 256 of them
    assert bits_per_weight(64, jnp.int8) + 32 / (64 * 256) == pytest.approx(4.127, abs=5e-4)


def test_the_qlora_base_stores_a_byte_per_code_on_cpu_and_packs_to_the_lessons_figures(student_and_qlora_base):
    _, base = student_and_qlora_base
    leaves = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(base)]
    codes = [x for _, x in leaves if x.dtype == jnp.uint4]
    n_codes = sum(x.size for x in codes)
    assert jnp.iinfo(jnp.uint4).bits == 4
    assert all(x.nbytes == x.size for x in codes)  # what the lesson's memory table counts
    stored = sum(x.nbytes for _, x in leaves)
    scale_bytes = sum(x.nbytes for name, x in leaves if "['array']['scale']" in name)
    assert (stored, stored - n_codes + n_codes // 2) == (187_392, 134_144)
    assert 4 * n_codes / (n_codes // 2 + scale_bytes) == pytest.approx(32 / bits_per_weight(32, jnp.float32))


def test_qwen3_0_6b_memory_figures_from_its_config():
    d, heads, kv_heads, head, ff, layers, vocab = 1024, 16, 8, 128, 3072, 28, 151_936
    projections = layers * (d * heads * head + 2 * d * kv_heads * head + heads * head * d + 3 * d * ff)
    embedding, norms = vocab * d, layers * (2 * d + 2 * head) + d
    total = projections + embedding + norms
    assert total == 596_049_920  # lesson 09's count from the config (tests/test_solutions.py)
    assert round(16 * total / 1e9, 1) == 9.5 and round(2 * total / 1e9, 2) == 1.19
    assert round((projections * bits_per_weight(32, jnp.float32) / 8 + 2 * (embedding + norms)) / 1e9, 2) == 0.59
