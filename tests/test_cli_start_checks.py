"""What would fail minutes into a run fails at its start, in one line naming the flag and the
fix: folders the command cannot write in. In-process (`cli.main`), before JAX is asked for anything."""

import json
from pathlib import Path

import pytest

from tunix_nb import cli

TINY = ["sft", "--model", "tiny", "--batch-size", "16", "--steps", "4"]
UNWRITABLE = "/sys/tunix_nb_test"  # sysfs takes no new files, even from root


@pytest.mark.parametrize("flag, value", [
    ("--ckpt-dir", f"{UNWRITABLE}/ckpt"),
    ("--metrics-file", f"{UNWRITABLE}/metrics.jsonl"),
    ("--export-params", f"{UNWRITABLE}/export"),
])
def test_an_output_folder_that_cannot_be_written_is_refused_at_the_start(capsys, flag, value):
    with pytest.raises(SystemExit) as stopped:
        cli.main([*TINY, flag, value])
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert f"error: {flag} {Path(value).parent if flag == '--metrics-file' else value}: cannot write in /sys" in err
    assert "choose a folder you can write to" in err and "Traceback" not in err


def test_an_existing_folder_that_cannot_be_written_is_refused_at_the_start(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main([*TINY, "--ckpt-dir", "/sys"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "error: --ckpt-dir /sys: cannot write in it" in err and "Traceback" not in err


def test_a_file_where_a_folder_would_go_is_refused(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(SystemExit):
        cli.main([*TINY, "--ckpt-dir", str(tmp_path / "taken" / "ckpt")])
    assert f"--ckpt-dir: {tmp_path / 'taken'} is a file" in capsys.readouterr().err
    assert not (tmp_path / "taken" / "ckpt").exists()


QWEN3 = Path(__file__).parent / "fixtures" / "hf" / "qwen3"  # ChatML's template, max_position_embeddings 128


@pytest.mark.parametrize("content, message", [
    (b"", "train.jsonl: the file is empty; give it the examples"),
    (b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "x"}\n',
     "train.jsonl line 2: byte 0xe9 at column 16 is not UTF-8; save the file as UTF-8"),
    (b'{"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}\n',
     "train.jsonl line 1: field 'messages' message 1 has role 'human'; roles are 'system', 'user', 'assistant', "
     "'tool'. Map the others before training (ShareGPT's 'human' is 'user', 'gpt' is 'assistant')"),
], ids=["empty", "not utf-8", "sharegpt roles"])
def test_a_data_file_the_run_cannot_read_right_is_named_in_one_line(tmp_path, capsys, content, message):
    train = tmp_path / "train.jsonl"
    train.write_bytes(content)
    argv = ["sft", "--model", str(QWEN3), "--train-file", str(train), "--batch-size", "1", "--steps", "1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --train-file: ") and message in err and err.count("\n") == 1, err


def test_devices_that_jit_would_leave_idle_are_refused(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main([*TINY, "--devices", "3"])
    assert stopped.value.code == 2
    assert "--devices 3 with --parallel jit would train on one of them; add --parallel dp" in capsys.readouterr().err


def test_generate_on_an_orbax_checkpoint_says_to_export_it_first(capsys):
    from tunix_nb import data, generate

    assert generate.main(["--model", str(data.DATA_DIR / "sft_student"), "--prompt", "2+2="]) == 2
    err = capsys.readouterr().err
    assert "config.json does not exist" in err and "holds Orbax checkpoints" in err
    assert "again with --export-hf OUT, which resumes at its last step" in err


@pytest.mark.parametrize("keep_bytes", [100, -1000], ids=["cut in the header", "cut in the data"])
def test_a_truncated_weight_file_is_named_with_the_fix(tmp_path, capsys, keep_bytes):
    import shutil

    model = tmp_path / "qwen3"
    shutil.copytree(Path(__file__).parent / "fixtures" / "hf" / "qwen3", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:keep_bytes])
    with pytest.raises(SystemExit) as stopped:
        cli.main(["sft", "--model", str(model), "--batch-size", "8", "--steps", "2"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err
    assert f"{weights}: not a whole safetensors file" in err and "download (or copy) it again" in err


def test_rows_past_the_models_positions_are_refused_unless_max_length_cuts_them(tmp_path, capsys):
    import json

    qwen3 = QWEN3
    rows = [{"prompt": "Count: " + " ".join(map(str, range(200))), "completion": " done"}] * 8
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["sft", "--model", str(qwen3), "--train-file", str(train), "--batch-size", "8", "--steps", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--train-file {train}: its longest row needs" in err and "past the model's max_position_embeddings 128" in err
    assert cli.main([*argv, "--max-length", "128"]) == 0


def test_grpo_prompts_and_completions_past_the_models_positions_name_both_fixes(tmp_path, capsys):
    """GRPO samples --max-new-tokens after each prompt: the refusal names a --max-length that leaves room
    for them, and fewer --max-new-tokens; a --max-length one token longer is refused too."""
    qwen3 = QWEN3
    rows = [{"prompt": "Count: " + " ".join(map(str, range(200))), "completion": " done"}] * 4
    train = tmp_path / "prompts.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["grpo", "--model", str(qwen3), "--train-file", str(train), "--max-new-tokens", "8", "--batch-size", "2",
            "--group-size", "2", "--steps", "1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --train-file {train}: its longest prompt (") and err.count("\n") == 1
    assert "tokens) and --max-new-tokens 8 need" in err and "past the model's max_position_embeddings 128" in err
    assert "pass --max-length 120 or less to cut the prompts' beginnings, or fewer --max-new-tokens" in err
    assert cli.main([*argv, "--max-length", "121"]) == 2
    assert "its longest prompt (121 tokens) and --max-new-tokens 8 need 129 positions" in capsys.readouterr().err
    from tunix_nb.tokenizer import HFTokenizer  # the advice holds: 120 tokens of prompt pass the check

    fitted = cli.encoded_user_data(cli.config_from_argv([*argv, "--max-length", "120"]), HFTokenizer.from_dir(qwen3))
    assert fitted.arrays["prompt_mask"].sum(axis=1).max() == 120


def test_a_generate_prompt_past_the_models_positions_is_refused_unless_max_length_cuts_it(capsys):
    from tunix_nb import generate

    qwen3 = QWEN3
    argv = ["--model", str(qwen3), "--prompt", "Count: " + " ".join(map(str, range(200))), "--max-new-tokens", "8"]
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the prompt (")
    assert "tokens) and --max-new-tokens 8 need" in err and "past the model's max_position_embeddings 128" in err
    assert "pass --max-length 120 or less to keep the prompt's last tokens" in err
    assert generate.main([*argv, "--max-length", "121"]) == 2  # one token too many
    assert "error: --max-length (121 tokens) and --max-new-tokens 8 need 129 positions" in capsys.readouterr().err
    assert generate.main([*argv, "--max-length", "120"]) == 0  # the prompt's last 120 tokens and 8 new ones fit


def test_a_metrics_file_of_another_run_is_moved_aside_not_cut(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    earlier = "".join(f'{{"step": {k}, "loss": 1.0}}\n' for k in range(1, 301))
    metrics.write_text(earlier)
    assert cli.main([*TINY, "--metrics-file", str(metrics)]) == 0
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.before-")]
    assert aside.read_text() == earlier  # nothing lost
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    assert f"held 300 rows of an earlier run; this run starts at step 0, so they were moved to {aside.name}" in \
        capsys.readouterr().out
