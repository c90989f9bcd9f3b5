"""python -m tunix_nb.train with --lora-rank: adapter-only checkpoints, resume after a kill,
the base as DPO's and GRPO's reference, the merged export."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_nb import checkpoint, compare, data, devices, dpo, lora, model, peft_adapter, preempt
from tunix_nb import cli as cli_module

LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
SFT = ["sft", "--model", "tiny", "--batch-size", "16", *LORA]
RUN = [*SFT, "--steps", "60", "--save-every", "10"]


@pytest.mark.parametrize("args, message", [
    (["sft", "--lora-alpha", "4"], "--lora-alpha need(s) --lora-rank: LoRA is off without it"),
    (["sft", "--quantize", "nf4"], "--quantize need(s) --lora-rank"),
    (["distill", "--lora-rank", "4"], "--lora-rank applies only to sft, dpo, grpo, not distill"),
    (["sft", "--lora-rank", "0"], "argument --lora-rank: 0 must be at least 1"),
    (["sft", "--lora-rank", "4", "--quantize", "fp4"], "argument --quantize: invalid choice: 'fp4'"),
    (["sft", "--lora-rank", "4", "--lora-targets", "nothing_here"], "matched no layer"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_lora_flags_are_checked(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli_module.main([*args, "--model", "tiny", "--steps", "2", "--batch-size", "8"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_reference")
    argv = [*RUN, "--ckpt-dir", str(root / "run"), "--metrics-file", str(root / "metrics.jsonl"),
            "--export-params", str(root / "export")]
    assert cli_module.main(argv) == 0
    return root


def test_checkpoints_hold_only_the_adapters(uninterrupted):
    saved = checkpoint.load_params(uninterrupted / "run")
    names = [model.param_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved)]
    assert names and all(n.endswith(("kernel_lora_a", "kernel_lora_b")) for n in names)
    meta = checkpoint.load_meta(uninterrupted / "run")
    assert {k: meta["config"][k] for k in cli_module.LORA_FLAGS} == {
        "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": cli_module.LORA_DEFAULT_TARGETS, "quantize": "none"}


def test_export_merges_the_adapters_into_a_plain_model(uninterrupted):
    """The exported model is the tiny preset (load_model builds it) with W + (alpha/rank) A B."""
    graphdef, merged, _ = checkpoint.load_model(uninterrupted / "export")
    base_graphdef, base = model.split(model.make_model("tiny", seed=0))
    lora_graphdef, adapters, frozen_base = lora.apply(base_graphdef, base, rank=4, alpha=8.0)
    adapters = checkpoint.params_into(adapters, checkpoint.load_params(uninterrupted / "run"))
    tokens = jnp.asarray(np.arange(3, 27).reshape(2, 12), jnp.int32)
    adapted = model.apply(lora_graphdef, lora.combine(adapters, frozen_base), tokens)
    np.testing.assert_allclose(model.apply(graphdef, merged, tokens), adapted, atol=1e-5)
    assert np.abs(adapted - model.apply(base_graphdef, base, tokens)).max() > 1e-2  # training moved it


def test_export_params_leaves_the_adapters_to_export_adapter(tmp_path):
    """--export-params writes the merged model, and --export-adapter in the same run still gets
    the trained adapters (it used to get the merged model, and the run failed there)."""
    argv = [*SFT, "--steps", "2", "--export-params", str(tmp_path / "params"),
            "--export-adapter", str(tmp_path / "adapter")]
    assert cli_module.main(argv) == 0
    base_graphdef, base = model.split(model.make_model("tiny", seed=0))
    lora_graphdef, adapters, frozen_base, _ = peft_adapter.load_adapter(tmp_path / "adapter", base_graphdef, base)
    assert max(float(np.abs(b).max()) for b in jax.tree.leaves(adapters)) > 0  # trained, not the initial B = 0
    graphdef, merged, _ = checkpoint.load_model(tmp_path / "params")
    tokens = jnp.asarray(np.arange(3, 27).reshape(2, 12), jnp.int32)
    np.testing.assert_allclose(model.apply(graphdef, merged, tokens),
                               model.apply(lora_graphdef, lora.combine(adapters, frozen_base), tokens), atol=1e-5)


def test_killed_mid_run_resumes_to_the_same_adapters_bitwise(tmp_path, uninterrupted):
    ckpt, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    argv = [*RUN, "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    killed = preempt.run_and_kill(argv, ckpt_dir=ckpt, metrics_file=metrics, when="between_saves", after_step=15,
                                  env=env, timeout=120)
    assert killed["killed"], killed
    if devices.holds_accelerator():  # the killed run computed on the CPU: so do the runs it is compared with
        uninterrupted = tmp_path / "whole"
        whole = [*RUN, "--ckpt-dir", str(uninterrupted / "run"), "--metrics-file", str(uninterrupted / "metrics.jsonl")]
        assert preempt.run_beside(whole, env=env).returncode == 0
        assert preempt.run_beside(argv, env=env).returncode == 0
    else:
        assert cli_module.main(argv) == 0
    assert compare.bitwise_equal(checkpoint.load_params(ckpt), checkpoint.load_params(uninterrupted / "run"))
    assert metrics.read_text() == (uninterrupted / "metrics.jsonl").read_text()


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_dpo_with_adapters_uses_the_base_as_its_reference(tmp_path, quantize):
    """At step 1 the adapters are off (B = 0), so the policy is the reference: every margin
    is 0 and the sigmoid loss is log 2 (with nf4, both are the quantised base). Up to float
    rounding: the cached reference log-probs come from another compiled program (chunks)."""
    metrics = tmp_path / "metrics.jsonl"
    argv = ["dpo", "--batch-size", "16", "--steps", "3", *LORA, "--quantize", quantize,
            "--metrics-file", str(metrics)]
    assert cli_module.main(argv) == 0
    first = json.loads(metrics.read_text().splitlines()[0])
    # sigmoid-loss at a zero margin is -log(sigmoid(0)): up to the backend's exp and log
    assert math.isclose(first["loss"], math.log(2),
                        abs_tol=compare.float32_bound(1, transcendentals=compare.log_softmax_transcendentals()))
    # margin = beta * ((chosen - its reference) - (rejected - its reference)): four sums of up to L
    # log-probs from two programs, each log-prob off by a log-softmax's float32_bound times
    # |log p| <= log V (5.7e-5 on a CPU, 2.7e-2 on a TPU). Measured on a TPU v5e: 4.3e-6 plain,
    # 5.4e-4 with nf4, 125 times further: the quantised base's two programs round apart there.
    bound = (dpo.DPOConfig().beta * 4 * data.DEFAULT_SEQ_LEN * math.log(model.PRESETS["tiny"].vocab_size)
             * compare.float32_bound(1, transcendentals=compare.log_softmax_transcendentals()))
    assert abs(first["rewards/margin"]) < bound


def test_grpo_with_adapters_starts_at_zero_kl_from_the_base(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    argv = ["grpo", "--batch-size", "4", "--group-size", "4", "--steps", "2", *LORA, "--metrics-file", str(metrics)]
    assert cli_module.main(argv) == 0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    # k3 = exp(d) - d - 1 at d = 0: exactly 0 on a CPU; a TPU's exp and two logs (the policy's
    # and the reference's log-probs, from two programs) leave up to float32_bound of them
    assert abs(lines[0]["kl"]) <= compare.float32_bound(1, transcendentals={"exp": 1, "log": 2})
    assert lines[1]["kl"] > 0.0
    assert all(np.isfinite(line["loss"]) for line in lines)
