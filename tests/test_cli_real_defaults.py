"""Issue 48, item 5: the command's defaults for real models. --epochs sets the steps from the
data, --export-from best|last, --max-length's default for a Hugging Face model, the exported
adapter's base_model_name_or_path, --dtype auto. In-process (`cli.main`)."""

import json
from pathlib import Path

import numpy as np
import pytest

from tunix_nb import checkpoint, cli

TINY = ["sft", "--model", "tiny", "--batch-size", "16"]
QWEN3 = Path(__file__).parent / "fixtures" / "hf" / "qwen3"


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    return err


def test_epochs_set_the_steps_from_the_data(tmp_path, capsys):
    rows = [{"prompt": f"add {a} {b}", "completion": f" {a + b}"} for a in range(5) for b in range(5)]  # 25
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [*TINY, "--train-file", train, "--epochs", "1.5", "--ckpt-dir", tmp_path / "ckpt"]
    assert cli.main([str(a) for a in argv]) == 0
    assert "--epochs 1.5: 3 steps (25 training examples, 16 a step)" in capsys.readouterr().out  # ceil(37.5 / 16)
    assert checkpoint.load_meta(tmp_path / "ckpt")["config"]["steps"] == 3


def test_epochs_and_steps_together_are_refused(capsys):
    err = _usage_error([*TINY, "--epochs", "1", "--steps", "3"], capsys)
    assert "error: --epochs 1 and --steps 3 both set the length of the run; give one" in err


@pytest.fixture(scope="module")
def best_run(tmp_path_factory):
    """4 steps at a learning rate that overshoots: eval/loss 5.57, 12.5, 13.4, 10.2 at steps 1-4."""
    out = tmp_path_factory.mktemp("best")
    argv = [*TINY, "--steps", "4", "--eval-every", "1", "--learning-rate", "1", "--ckpt-dir", out / "ckpt",
            "--export-params", out / "best_export", "--export-from", "best"]
    assert cli.main([str(a) for a in argv]) == 0
    return out


def test_export_from_best_writes_the_best_checkpoint(best_run):
    exported, meta = checkpoint.load_params_and_meta(best_run / "best_export")
    best, best_meta = checkpoint.load_params_and_meta(best_run / "ckpt" / "best")
    assert meta["step"] == best_meta["step"] == 1  # not the last step, 4
    for a, b in zip(*(jax_leaves(t) for t in (exported, best))):
        np.testing.assert_array_equal(a, b)
    last = checkpoint.load_params(best_run / "ckpt")
    assert any((a != b).any() for a, b in zip(jax_leaves(exported), jax_leaves(last)))


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.parametrize("extra, message", [
    (["--export-params", "x"], "--export-from best exports <--ckpt-dir>/best, the best checkpoint by eval loss: "
                               "add --eval-every N and --ckpt-dir"),
    (["--eval-every", "2", "--ckpt-dir", "c"], "--export-from best chooses what --export-params, --export-hf or "
                                               "--export-adapter write: add one of them"),
])
def test_export_from_best_needs_an_eval_a_ckpt_dir_and_an_export(capsys, extra, message):
    assert message in _usage_error([*TINY, "--steps", "4", "--export-from", "best", *extra], capsys)


def test_the_adapters_base_is_an_absolute_folder_peft_can_find(tmp_path, monkeypatch):
    """--model given as a relative folder: the adapter names it absolutely, for a loader elsewhere."""
    import shutil

    shutil.copytree(QWEN3, tmp_path / "models" / "qwen3")
    monkeypatch.chdir(tmp_path / "models")
    argv = ["sft", "--model", "qwen3", "--lora-rank", "2", "--batch-size", "8", "--steps", "1",
            "--export-adapter", str(tmp_path / "adapter")]
    assert cli.main(argv) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "models" / "qwen3").resolve())


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    """The qwen3 fixture declaring Qwen3-0.6B's 40,960 positions."""
    import shutil

    folder = tmp_path_factory.mktemp("long") / "qwen3_40960"
    shutil.copytree(QWEN3, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40960}))
    return folder


def test_max_length_defaults_for_a_real_model_and_a_run_keeps_its_recorded_value(long_context_model, tmp_path,
                                                                                 monkeypatch, capsys):
    import importlib

    run_config = importlib.import_module("tunix_nb.cli.run_config")
    rows = [{"prompt": f"add {a} 1", "completion": f" {a + 1}"} for a in range(8)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["sft", "--model", str(long_context_model), "--train-file", str(train), "--batch-size", "8",
            "--steps", "2", "--ckpt-dir", str(tmp_path / "ckpt")]
    assert cli.config_from_argv(argv).data.max_length == 1024
    assert "--max-length default: 1024 tokens a row (the model declares 40,960 positions" in capsys.readouterr().out
    # a run begun before the default (max_length None recorded) resumes with its own value
    with monkeypatch.context() as before:
        before.setattr(run_config, "default_max_length", lambda data, method, model_dir: (data, ()))
        assert cli.main([*argv, "--stop-after", "1"]) == 0
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"--max-length: None, as the run in --ckpt-dir {tmp_path / 'ckpt'} recorded it (today's default: 1024)" in out
    assert "Resuming from the checkpoint at step 1" in out and checkpoint.load_meta(tmp_path / "ckpt")["step"] == 2
    # a value given as a flag is checked as before
    assert cli.main([*argv[:-2], "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", "3", "--max-length", "64"]) == 2


@pytest.fixture
def on_a_tpu(monkeypatch):
    """The backend's defaults as on a TPU (tests/test_devices.py's way of faking an accelerator)."""
    from tunix_nb import devices

    tpu = devices.defaults_for("tpu")
    monkeypatch.setattr(devices, "defaults_for", lambda backend=None, **_: tpu)


def test_dtype_auto_keeps_a_lora_base_in_bfloat16_on_an_accelerator(on_a_tpu, capsys):
    lora = cli.config_from_argv(["sft", "--model", str(QWEN3), "--lora-rank", "4"])
    assert lora.source.dtype == "bfloat16" and lora.training.compute_dtype == "bfloat16"
    assert "--dtype auto: bfloat16 (the frozen base under --lora-rank" in capsys.readouterr().out
    full = cli.config_from_argv(["sft", "--model", str(QWEN3)])
    assert full.source.dtype == "float32"  # AdamW keeps updating float32 weights
    assert "--dtype auto: float32 (full fine-tuning" in capsys.readouterr().out
    assert cli.config_from_argv(["sft", "--model", "tiny", "--lora-rank", "4"]).source.dtype == "float32"


@pytest.mark.cpu_only(reason="\"auto\" is bfloat16 on an accelerator")
def test_dtype_auto_on_the_cpu_is_float32():
    assert cli.config_from_argv(["sft", "--model", str(QWEN3), "--lora-rank", "4"]).source.dtype == "float32"


def test_a_run_saved_in_float32_resumes_in_float32_under_dtype_auto(tmp_path, capsys):
    argv = ["sft", "--model", str(QWEN3), "--lora-rank", "2", "--batch-size", "8", "--steps", "2",
            "--compute-dtype", "bfloat16", "--ckpt-dir", str(tmp_path / "ckpt")]
    assert cli.main([*argv, "--dtype", "float32", "--stop-after", "1"]) == 0  # as runs before auto recorded it
    assert cli.main(argv) == 0  # auto would choose bfloat16 here
    out = capsys.readouterr().out
    assert f"--dtype: float32, as the run in --ckpt-dir {tmp_path / 'ckpt'} recorded it (today's default: bfloat16)" in out
    assert checkpoint.load_meta(tmp_path / "ckpt")["config"]["dtype"] == "float32"
