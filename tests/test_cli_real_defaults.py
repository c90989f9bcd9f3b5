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
