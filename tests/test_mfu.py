"""tunix_nb.mfu: a step's model FLOPs against a count by hand and against XLA's count of the
kit's step, and the chip's peak by device kind (issue 47, items 5 and 8)."""

import types

import jax
import numpy as np
import pytest

from tunix_nb import lora, mfu, model, sft, train
from tunix_nb.bench.common import compiled_cost

# d 128, GQA 4/2 with head_dim 32, d_ff 512, 2 layers, the byte vocabulary; B x L = 4 x 64
CONFIG = model.ModelConfig(vocab_size=259, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=512)
BATCH, SEQ = 4, 64


def test_the_count_by_hand():
    # per block: q 128x128, k and v 128x64 each, out 128x128, gate/up/down 128x512 each
    per_block = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 512
    n = 2 * per_block + 259 * 128  # and the LM head (tied: counted once, as a matmul)
    assert mfu.matmul_params(CONFIG) == n == 524_672
    attention = 12 * 2 * 64 * 4 * 32  # layers x seq x heads x head_dim, forward and backward
    tokens = BATCH * SEQ
    assert mfu.step_flops(CONFIG, batch=BATCH, seq_len=SEQ) == (6 * n + attention) * tokens
    assert mfu.step_flops(CONFIG, batch=BATCH, seq_len=SEQ, causal_halving=True) == (6 * n + attention / 2) * tokens
    # a frozen base: no weight gradients (4N), the adapters' own 6 per parameter
    assert mfu.step_flops(CONFIG, batch=BATCH, seq_len=SEQ, adapter_params=1000) == (
        4 * n + 6 * 1000 + attention) * tokens


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="batch must be a positive int, got 0"):
        mfu.step_flops(CONFIG, batch=0, seq_len=SEQ)
    with pytest.raises(ValueError, match="adapter_params must be None .full fine-tuning. or a count >= 0"):
        mfu.step_flops(CONFIG, batch=1, seq_len=SEQ, adapter_params=-5)
    with pytest.raises(ValueError, match="step_seconds and the peak must be positive"):
        mfu.utilisation(1e12, 0.0, 197e12)


def _xla_flops(remat: bool, rank: int | None):
    """XLA's FLOPs of the kit's SFT step (float32 on the CPU), lowered from shapes alone: XLA's
    cost analysis of the program JAX hands it, not compiled (test_the_chip_figure_... and the
    measure_command tests count compiled programs)."""
    graphdef, params = model.abstract_model(model.get_config(CONFIG, remat=remat))
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), np.float32 if k == "loss_mask" else np.int32)
             for k in ("inputs", "targets", "loss_mask", "attention_mask")}
    optimizer = train.make_optimizer(train.OptimizerConfig(total_steps=100))
    if rank is None:
        step = train.make_step(sft.objective(graphdef, compute_dtype=np.float32), optimizer)
        lowered = step.lower(params, jax.eval_shape(optimizer.init, params), batch)
        return compiled_cost(lowered)["flops"], None
    built = {}

    def adapt(p):  # qwix traced over shapes only, as the memory plan does
        built["graphdef"], adapters, base = lora.apply(graphdef, p, rank=rank)
        return adapters, base

    adapters, base = jax.eval_shape(adapt, params)
    step = train.make_step(lora.objective(sft.objective(built["graphdef"], compute_dtype=np.float32)), optimizer)
    lowered = step.lower(adapters, jax.eval_shape(optimizer.init, adapters), batch, lora.frozen(base))
    return compiled_cost(lowered)["flops"], model.count_params(adapters)


def test_the_count_agrees_with_xla_on_the_kit_s_step():
    """Without remat XLA's count of the step (CPU) is the model count within 4%: XLA
    also counts the elementwise ops, the softmax and AdamW's update (and, with a frozen base,
    skips the first block's input gradient, which nothing needs). With remat XLA counts each
    block's forward again: tests/test_measure_command.py checks that through the command."""
    full, _ = _xla_flops(remat=False, rank=None)
    assert 1.0 <= full / mfu.step_flops(CONFIG, batch=BATCH, seq_len=SEQ) < 1.04
    frozen, adapters = _xla_flops(remat=False, rank=8)
    assert adapters == 2 * 8 * ((128 + 128) + 2 * (128 + 64) + (128 + 128) + 3 * (128 + 512))  # r x (in + out)
    assert 0.97 < frozen / mfu.step_flops(CONFIG, batch=BATCH, seq_len=SEQ, adapter_params=adapters) < 1.04


@pytest.mark.parametrize("kind, chip, peak", [
    ("TPU v5 lite", "TPU v5e", 197e12), ("TPU v5e", "TPU v5e", 197e12), ("TPU v5", "TPU v5p", 459e12),
    ("TPU v5p", "TPU v5p", 459e12), ("TPU v6 lite", "TPU v6e", 918e12), ("TPU v4", "TPU v4", 275e12),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12), ("NVIDIA H100 80GB HBM3", "H100", 989e12),
    ("NVIDIA L4", "L4", 121e12), ("Tesla T4", "T4", 65e12),
])
def test_the_peak_by_device_kind(kind, chip, peak):
    found = mfu.peak_for(kind)
    assert (found.chip, found.flops_per_second) == (chip, peak)
    assert found.dtype == ("float16" if chip == "T4" else "bfloat16")


@pytest.mark.parametrize("kind", ["cpu", "TPU v4 lite", "NVIDIA L40S", "TPU v3"])
def test_chips_not_in_the_table_have_no_peak(kind):
    assert mfu.peak_for(kind) is None


CPU_DEVICE = types.SimpleNamespace(device_kind="cpu", platform="cpu")


def test_the_peak_of_the_device_jax_sees(monkeypatch):
    """JAX's first device, faked as a CPU and as a v5e chip (whichever backend the tests run on)."""
    assert mfu.device_peak() == mfu.peak_for(jax.devices()[0].device_kind)
    monkeypatch.setattr(jax, "devices", lambda *a: [CPU_DEVICE])
    assert mfu.device_peak() is None
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(device_kind="TPU v5 lite", platform="tpu")])
    peak = mfu.device_peak()
    assert peak.chip == "TPU v5e" and mfu.utilisation(197e12 * 0.5, 1.0, peak) == 0.5


def test_the_bench_group_measures_a_real_size_model_on_a_chip_only(monkeypatch):
    """The mfu group's dispatch, on a faked CPU and on a faked v5e: the small model's figure
    stays the CPU's; on the chip, train_step_mfu is the real-size model's, the small one a detail."""
    from tunix_nb.bench import mfu as group

    small = {"train_step_mfu": {"value": 0.1, "matmul_peak_flops_per_second": 1e12, "model": {}},
             "backward_over_forward": {"value": 2.0}}
    chip_calls = []
    monkeypatch.setattr(group, "bench_mfu", lambda repeats, quick: {k: dict(v) for k, v in small.items()})
    monkeypatch.setattr(group, "bench_mfu_on_chip", lambda peak, repeats, **kw: chip_calls.append((peak, kw)) or {
        "train_step_mfu": {"value": 0.3, "chip": peak.chip}})
    monkeypatch.setattr(jax, "devices", lambda *a: [CPU_DEVICE])  # also where the tests hold a chip
    assert group.measure(quick=True, repeats=3) == small and chip_calls == []
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(device_kind="TPU v5 lite", platform="tpu")])
    figures = group.measure(quick=True, repeats=3)
    assert figures["train_step_mfu"] == {"value": 0.3, "chip": "TPU v5e"} and figures["backward_over_forward"]
    (peak, kw), = chip_calls
    assert peak.flops_per_second == 197e12 and kw["small_model"]["value"] == 0.1 and kw["quick"] is True


def test_the_chip_figure_is_model_flops_over_the_step_time_and_the_peak():
    """bench_mfu_on_chip itself, run on the CPU at a tiny size against a v5e's peak."""
    from tunix_nb.bench import mfu as group

    config = model.ModelConfig(vocab_size=512, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                               d_ff=128)
    fig = group.bench_mfu_on_chip(mfu.peak_for("TPU v5 lite"), 3, quick=True, config=config, batch=2,
                                  seq_len=64)["train_step_mfu"]
    flops = mfu.step_flops(config, batch=2, seq_len=64)
    assert fig["model_flops_per_step"] == flops and fig["chip"] == "TPU v5e"
    assert fig["value"] == pytest.approx(flops / fig["step_seconds"] / 197e12)  # the median of 3 calls
    assert fig["xla_flops_per_step"] > flops  # and the elementwise ops, AdamW's update


def test_the_chip_model_takes_the_commands_remedies():
    """The real-size model the mfu group times on a chip runs as the command runs it there: its
    blocks as one scan under remat, with the splash kernel a TPU gets from --attention auto (the
    einsums elsewhere); 4 of its 28 layers with --quick."""
    from tunix_nb.bench import mfu as group

    on_tpu, on_cpu = group.chip_config(quick=False, backend="tpu"), group.chip_config(quick=True, backend="cpu")
    assert (on_tpu.n_layers, on_tpu.scan_layers, on_tpu.remat, on_tpu.attention) == (28, True, True, "splash")
    assert (on_cpu.n_layers, on_cpu.attention) == (4, "xla")
