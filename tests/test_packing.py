"""Sequence packing (tunix_nb.packing): the packer, the model's segment ids, and the
packed SFT and distillation objectives against the unpacked ones."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunix_nb import data, distill, sft
from tunix_nb import model as M
from tunix_nb import packing as P
from tunix_nb.bench import packing as packing_group

RESULTS = Path(__file__).resolve().parent.parent / "results" / "bench.json"  # its "packing" record
MAX_LEN = 32
# A packed example's logits against the same example run alone: a [1, n] input is another
# XLA program than a [R, 32] one, so its dot products may accumulate in another order;
# the masked keys themselves add exact zeros (exp(-1e9 - max) underflows to 0). Float32
# rounding (eps 1.2e-7) on logits of magnitude ~5 through a block: the bound the kit's
# padding tests use (tests/test_model.py).
LOGIT_ATOL = 1e-5
# Sums over ~100 tokens and gradients summed in another order: float32 rounding, relative.
SUM_RTOL = 1e-6
GRAD_RTOL = 1e-5  # of the largest gradient entry


@pytest.fixture(scope="module")
def examples():
    return P.synthetic_examples(9, min_length=3, max_length=MAX_LEN, seed=3)


@pytest.fixture(scope="module")
def tiny():
    return M.split(M.make_model("tiny", seed=0))


@pytest.fixture(scope="module")
def packed(examples):
    return P.pack(examples, P.PackingConfig(max_length=MAX_LEN))


def _coverage(layout):
    """How many examples claim each token slot of the packed batch."""
    claims = np.zeros(layout.shape, int)
    for r, start, n in zip(layout.row_N, layout.start_N, layout.length_N):
        claims[r, start:start + n] += 1
    return claims


@pytest.mark.parametrize("cfg", [P.PackingConfig(max_length=MAX_LEN),
                                 P.PackingConfig(max_length=MAX_LEN, strategy="next_fit"),
                                 P.PackingConfig(max_length=MAX_LEN, padding_free=True, pad_to_multiple_of=16)])
def test_every_token_is_kept_once_in_rows_no_longer_than_allowed(examples, cfg):
    batch, layout = P.pack(examples, cfg)
    lengths = examples["attention_mask"].sum(1)
    claims = _coverage(layout)
    assert claims.max() == 1 and claims.sum() == lengths.sum()
    assert np.array_equal(batch["attention_mask"], claims)  # real exactly where an example lies
    assert batch["inputs"].shape[1] == (MAX_LEN if not cfg.padding_free else -(-lengths.sum() // 16) * 16)
    for key in P.ROW_KEYS:
        back = P.unpack(batch[key], layout)
        for i, n in enumerate(lengths):
            assert np.array_equal(back[i, :n], examples[key][i, :n]), (key, i)


def test_segments_number_the_examples_of_a_row_and_positions_restart(packed):
    batch, layout = packed
    for r in range(layout.shape[0]):
        ids = batch["segment_ids"][r]
        members = np.flatnonzero(layout.row_N == r)
        assert sorted(layout.segment_N[members]) == list(range(1, len(members) + 1))
        assert set(ids[ids > 0]) == set(layout.segment_N[members]) and np.all(ids[batch["attention_mask"][r] == 0] == 0)
    for i, (r, start, n) in enumerate(zip(layout.row_N, layout.start_N, layout.length_N)):
        assert np.array_equal(batch["positions"][r, start:start + n], np.arange(n))
    # the model derives the same positions from the segment ids alone
    _, positions = M.segment_attention(batch["inputs"].shape, batch["attention_mask"], batch["segment_ids"])
    real = batch["attention_mask"] > 0
    assert np.array_equal(np.asarray(positions)[real], batch["positions"][real])


def test_first_fit_decreasing_needs_no_more_rows_than_next_fit_and_is_deterministic(examples):
    lengths = examples["attention_mask"].sum(1)
    ffd = P.first_fit_decreasing(lengths, MAX_LEN)
    assert -(-lengths.sum() // MAX_LEN) <= len(ffd) <= len(P.next_fit(lengths, MAX_LEN))
    assert ffd == P.first_fit_decreasing(lengths.copy(), MAX_LEN)
    a, _ = P.packed_batch_at(examples, 2, 4, seed=7, cfg=P.PackingConfig(max_length=MAX_LEN, num_rows=4))
    b, _ = P.packed_batch_at(examples, 2, 4, seed=7, cfg=P.PackingConfig(max_length=MAX_LEN, num_rows=4))
    c, _ = P.packed_batch_at(examples, 3, 4, seed=7, cfg=P.PackingConfig(max_length=MAX_LEN, num_rows=4))
    assert all(np.array_equal(a[k], b[k]) for k in a) and a["inputs"].shape == (4, MAX_LEN)
    assert not np.array_equal(a["inputs"], c["inputs"])


def test_bad_input_raises_errors_that_name_the_fix(examples):
    lengths = examples["attention_mask"].sum(1)
    first = int(np.flatnonzero(lengths > 8)[0])
    with pytest.raises(data.DataError, match=rf"example {first} has {lengths[first]} tokens.*max_length=8.*"
                                             rf"max_length to {lengths.max()}.*seq_len=8, truncate=True"):
        P.pack(examples, P.PackingConfig(max_length=8))
    with pytest.raises(data.DataError, match="needs .* packed rows but PackingConfig.num_rows=1"):
        P.pack(examples, P.PackingConfig(max_length=MAX_LEN, num_rows=1))
    left = dict(examples, attention_mask=examples["attention_mask"][:, ::-1].copy())
    with pytest.raises(data.DataError, match="example 0: its attention_mask is not ones then zeros"):
        P.pack(left, P.PackingConfig(max_length=MAX_LEN))
    with pytest.raises(data.DataError, match="missing \\['loss_mask'\\]"):
        P.pack({k: v for k, v in examples.items() if k != "loss_mask"}, P.PackingConfig(max_length=MAX_LEN))
    with pytest.raises(ValueError, match=r"segment_ids has shape \(2, 5\) but tokens have shape \(2, 4\)"):
        M.segment_attention((2, 4), None, jnp.ones((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="strategy must be one of"):
        P.PackingConfig(strategy="best_fit")
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        P.PackingConfig(max_length=0)


def test_a_token_never_sees_another_example(tiny, examples):
    graphdef, params = tiny
    batch, layout = P.pack(examples, P.PackingConfig(max_length=MAX_LEN, strategy="next_fit"))
    crowded = int(np.argmax(np.bincount(layout.row_N)))
    middle = np.flatnonzero(layout.row_N == crowded)[1]
    r, start, n = layout.row_N[middle], layout.start_N[middle], layout.length_N[middle]
    perturbed = dict(batch, inputs=batch["inputs"].copy())
    perturbed["inputs"][r, start:start + n] = (perturbed["inputs"][r, start:start + n] + 7) % 250 + 3
    apply_packed = jax.jit(P.apply_packed, static_argnums=0)
    a, b = apply_packed(graphdef, params, batch), apply_packed(graphdef, params, perturbed)
    # every real token but the perturbed example's, in its row and the others (a padding
    # query sees no key, so its output, an even mix of all values, is no example's)
    mine = np.zeros(layout.shape, bool)
    mine[r, start:start + n] = True
    others = (batch["attention_mask"] > 0) & ~mine
    assert others[r].any() and jnp.array_equal(a[others], b[others])
    assert not jnp.array_equal(a[r, start:start + n], b[r, start:start + n])


def test_each_packed_example_scores_as_it_does_alone(tiny, examples, packed):
    graphdef, params = tiny
    batch, layout = packed
    apply = jax.jit(M.apply, static_argnums=0)
    per_example = P.unpack(jax.jit(P.apply_packed, static_argnums=0)(graphdef, params, batch), layout)
    padded = apply(graphdef, params, examples["inputs"], examples["attention_mask"])
    for i, n in enumerate(layout.length_N):
        np.testing.assert_allclose(per_example[i, :n], padded[i, :n], atol=LOGIT_ATOL, rtol=0)
    free_batch, free_layout = P.pack(examples, P.PackingConfig(max_length=MAX_LEN, padding_free=True,
                                                               pad_to_multiple_of=16))
    free = P.unpack(jax.jit(P.apply_packed, static_argnums=0)(graphdef, params, free_batch), free_layout)
    np.testing.assert_allclose(free, per_example, atol=LOGIT_ATOL, rtol=0)  # padding-free equals packed
    for i in np.argsort(layout.length_N)[[0, -1]]:  # the shortest and the longest, each in a row of its own
        n = layout.length_N[i]
        alone = apply(graphdef, params, examples["inputs"][i:i + 1, :n])
        np.testing.assert_allclose(per_example[i, :n], alone[0], atol=LOGIT_ATOL, rtol=0)


def _old_forward(graphdef, params, tokens, mask):
    """A transcription of `Transformer.__call__` before segment ids: its positions and mask."""
    module = nnx.merge(graphdef, params)
    real = mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(real, axis=-1) - 1, 0)
    L = tokens.shape[1]
    allowed = jnp.tril(jnp.ones((L, L), bool))[None] & real[:, None, :]
    return module._run(tokens, positions, allowed)[0]


def test_model_without_segment_ids_is_bitwise_unchanged(examples):
    graphdef, params = M.split(M.make_model("student", seed=0))
    tokens, mask = jnp.asarray(examples["inputs"][:3]), jnp.asarray(examples["attention_mask"][:3])
    # jitted both, as M.apply runs when called eagerly: one program each, the same arithmetic
    old_forward = jax.jit(_old_forward, static_argnums=0)
    assert jnp.array_equal(M.apply(graphdef, params, tokens, mask), old_forward(graphdef, params, tokens, mask))
    assert jnp.array_equal(M.apply(graphdef, params, tokens), old_forward(graphdef, params, tokens,
                                                                         jnp.ones_like(tokens)))


def _value_and_grad(objective, params, batch, frozen=None):
    """(loss sum, weight, metrics, grads), compiled: one program instead of many small ones."""
    @jax.jit
    def run(params, batch, frozen):
        (loss_sum, (weight, metrics)), grads = jax.value_and_grad(
            lambda p: (lambda s, w, m: (s, (w, m)))(*objective(p, batch, frozen)), has_aux=True)(params)
        return loss_sum, weight, metrics, grads

    return run(params, batch, frozen)


def _assert_same_grads(a, b):
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(a))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, atol=GRAD_RTOL * scale, rtol=0)


def test_sft_loss_sum_count_and_grads_equal_the_unpacked_and_padding_free(tiny, examples, packed):
    graphdef, params = tiny
    ref_sum, ref_count, _, ref_grads = _value_and_grad(sft.objective(graphdef, compute_dtype="float32"),
                                                       params, examples)
    padding_free, _ = P.pack(examples, P.PackingConfig(max_length=MAX_LEN, padding_free=True, pad_to_multiple_of=16))
    for batch in (packed[0], padding_free):
        s, count, _, grads = _value_and_grad(P.sft_objective(graphdef, compute_dtype="float32"), params, batch)
        assert float(count) == float(ref_count) == examples["loss_mask"].sum()
        np.testing.assert_allclose(s, ref_sum, rtol=SUM_RTOL)
        _assert_same_grads(ref_grads, grads)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_distillation_loss_sum_metrics_and_grads_equal_the_unpacked(tiny, examples, packed, beta):
    graphdef, params = tiny
    teacher_graphdef, teacher_params = M.split(M.make_model("tiny", seed=1, d_model=48))
    kwargs = dict(temperature=2.0, alpha=0.3, beta=beta, compute_dtype="float32")
    examples = dict(examples, loss_mask=examples["loss_mask"].copy())
    examples["loss_mask"][4] = 0  # an example without loss tokens: loss 0, still one example
    ref = _value_and_grad(distill.objective(graphdef, teacher_graphdef, **kwargs), params, examples, teacher_params)
    batch = P.pack(examples, P.PackingConfig(max_length=MAX_LEN))[0]
    got = _value_and_grad(P.distill_objective(graphdef, teacher_graphdef, **kwargs), params, batch, teacher_params)
    assert float(got[1]) == float(ref[1]) == len(examples["inputs"])
    np.testing.assert_allclose(got[0], ref[0], rtol=SUM_RTOL)
    for name, (total, count) in got[2].items():
        np.testing.assert_allclose(total / count, ref[2][name], rtol=SUM_RTOL)
    _assert_same_grads(ref[3], got[3])


def test_chunked_sft_reads_packed_batches_too(tiny, examples, packed):
    """sft.objective's chunked log-probs (vocab_chunks) on packed rows: the unpacked sums."""
    graphdef, params = tiny
    kwargs = dict(compute_dtype="float32", vocab_chunk=64, seq_chunk=8)  # 259 tokens: 5 chunks
    ref = _value_and_grad(sft.objective(graphdef, **kwargs), params, examples)
    got = _value_and_grad(P.sft_objective(graphdef, **kwargs), params, packed[0])
    assert float(got[1]) == float(ref[1]) == examples["loss_mask"].sum()
    np.testing.assert_allclose(got[0], ref[0], rtol=SUM_RTOL)
    _assert_same_grads(ref[3], got[3])


@pytest.mark.parametrize("beta,alpha", [(0.0, 0.3), (0.5, 0.3), (1.0, 0.0)])
def test_chunked_packed_distillation_equals_the_unpacked_full_logits(tiny, examples, beta, alpha):
    """packing.distill_objective's chunked path (vocab_chunks, both models' hidden states) on
    packed rows: the unpacked full-logits loss sum, metrics and gradients (alpha 0: no teacher)."""
    graphdef, params = tiny
    teacher_graphdef, teacher_params = M.split(M.make_model("tiny", seed=1, d_model=48))
    kwargs = dict(temperature=2.0, alpha=alpha, beta=beta, compute_dtype="float32")
    ref = _value_and_grad(distill.objective(graphdef, teacher_graphdef, **kwargs), params, examples, teacher_params)
    batch = P.pack(examples, P.PackingConfig(max_length=MAX_LEN))[0]
    chunked = P.distill_objective(graphdef, teacher_graphdef, vocab_chunk=64, seq_chunk=8, **kwargs)  # 5 chunks
    got = _value_and_grad(chunked, params, batch, teacher_params)
    assert float(got[1]) == float(ref[1]) == len(examples["inputs"])
    np.testing.assert_allclose(got[0], ref[0], rtol=SUM_RTOL)
    for name, (total, count) in got[2].items():
        np.testing.assert_allclose(total / count, ref[2][name], rtol=SUM_RTOL)
    _assert_same_grads(ref[3], got[3])


def test_rows_needed_is_the_fullest_steps_row_count(examples):
    """The static row count a run's steps share (PackingConfig.num_rows), from lengths alone."""
    cfg = P.PackingConfig(max_length=MAX_LEN)
    counts = [P.packed_batch_at(examples, k, 4, seed=7, cfg=cfg)[1].shape[0] for k in range(6)]
    assert P.rows_needed(examples, steps=6, batch_size=4, seed=7, cfg=cfg) == max(counts)
    assert P.rows_needed(examples, steps=1, batch_size=4, seed=7, cfg=cfg) == counts[0]
    assert P.rows_needed(examples, steps=6, batch_size=4, seed=7, cfg=dataclasses.replace(cfg, padding_free=True)) == 1


def test_segment_means_average_each_example_then_sum():
    values = jnp.array([[1.0, 3.0, 10.0, 20.0, 0.0], [5.0, 7.0, 9.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0, 0], [0, 1, 1, 0, 0]])
    segments = jnp.array([[1, 1, 2, 2, 0], [1, 1, 1, 2, 0]])
    total, n = P.segment_means(values, mask, segments)
    # row 0: (1+3)/2 and 10/1; row 1: (7+9)/2 and an example with no loss token (0)
    assert float(n) == 4 and float(total) == pytest.approx(2.0 + 10.0 + 8.0 + 0.0)


def test_throughput_comparison_reports_every_layout():
    result = packing_group.throughput_comparison(batch_size=4, max_length=32, min_length=3, preset="tiny", repeats=1,
                                     pad_to_multiple_of=16, n_batches_for_padding=2)
    tokens = result["tokens_per_batch"]
    assert result["padding_fraction"]["padding"] == pytest.approx(1 - tokens / (4 * 32))
    assert result["padding_fraction"]["packing"] <= result["padding_fraction"]["padding"]
    losses = list(result["loss"].values())
    np.testing.assert_allclose(losses, losses[0], rtol=SUM_RTOL)  # the same batch, three layouts
    assert set(result["tokens_per_second"]) == {"padding", "packing", "padding_free"}


def test_stored_measurement_is_consistent_and_says_how_it_was_made():
    stored = json.loads(RESULTS.read_text())[packing_group.RECORD]
    assert stored["command"].startswith("python -m tunix_nb.bench --only packing") and not stored["quick"]
    assert stored["machine"]["backend"] and stored["machine"]["device_kind"]
    tokens, (B, L) = stored["tokens_per_batch"], stored["shapes"]["padding"]
    assert stored["padding_fraction"]["padding"] == pytest.approx(1 - tokens / (B * L))
    for name in ("padding", "packing", "padding_free"):
        rows, length = stored["shapes"][name]
        assert stored["padding_fraction"][name] == pytest.approx(1 - tokens / (rows * length))
        assert stored["tokens_per_second"][name] == pytest.approx(tokens / stored["seconds_per_step"][name]["median"])
        assert stored["tokens_per_second_ratio"][name] == pytest.approx(
            stored["tokens_per_second"][name] / stored["tokens_per_second"]["padding"])
    for name in ("packing", "padding_free"):
        spread = stored["speedup_over_padding"][name]
        assert spread["q25"] <= spread["median"] <= spread["q75"] and spread["rounds"] >= 5
    mean = stored["padding_fraction_mean"]
    assert mean["packing"] < mean["padding"] and 0 <= mean["padding_free"] < mean["padding"]
    # the figure: the per-round ratios' median, against the issue's target of 1.5x
    fig = stored["packing_over_padding"]
    assert fig["spread"] == stored["speedup_over_padding"]["packing"] and fig["value"] == fig["spread"]["median"]
    assert fig["target"] == packing_group.FIGURES["packing_over_padding"][0] == 1.5 and fig["comparable_to_target"]
    assert fig["meets_target"] == (fig["value"] >= fig["target"])
