"""Lesson 12's GRPO recipe runs as written: its prompt line, reward module and command are read
from the lesson, run through `cli.main` on the tiny Qwen3 fixture with Qwen3's real template
(instead of the Hub's Qwen3-0.6B), a few steps long."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from tunix_nb import cli, hf

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "12_your_model_and_data.ipynb"
HF = ROOT / "tests" / "fixtures" / "hf"
FEW_STEPS = ["--steps", "1", "--batch-size", "2", "--group-size", "2", "--metrics-file", "m.jsonl"]


def recipe_blocks() -> dict[str, str]:
    """{language: code} of the fenced blocks in the lesson's GRPO recipe."""
    cells = json.loads(LESSON.read_text())["cells"]
    text = next("".join(c["source"]) for c in cells if "The recipe for GRPO" in "".join(c["source"]))
    recipe = text.split("The recipe for GRPO", 1)[1].split("## Exercises", 1)[0]
    return dict(re.findall(r"```(\w+)\n(.*?)```", recipe, re.S))


@pytest.fixture
def recipe_folder(tmp_path, monkeypatch):
    """A working directory holding the recipe's prompts.jsonl (its line, with a second answer)
    and my_rewards.py, and the Qwen3 fixture with Qwen3's real template."""
    blocks = recipe_blocks()
    row = json.loads(blocks["json"])
    other = {"prompt": [{"role": "user", "content": "What is 2 + 3? Reply with the number only."}], "answer": "5"}
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [row, other] * 2))
    (tmp_path / "my_rewards.py").write_text(blocks["python"])
    shutil.copytree(HF / "qwen3", tmp_path / "qwen3")
    shutil.copy(HF / "qwen3_template" / "tokenizer_config.json", tmp_path / "qwen3" / "tokenizer_config.json")
    monkeypatch.chdir(tmp_path)  # the reward module is found in the working directory, as in the recipe
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_rewards", None)  # other tests write their own my_rewards.py


def test_the_recipe_is_one_command_with_your_reward_alone():
    argv = shlex.split(recipe_blocks()["bash"].replace("\\\n", " "))
    assert argv[:4] == ["python", "-m", "tunix_nb.train", "grpo"]
    assert "--rewards" not in argv and "--reward-funcs" in argv and "--max-new-tokens" in argv


def test_lesson_12s_grpo_recipe_runs_as_written(recipe_folder, capsys):
    argv = shlex.split(recipe_blocks()["bash"].replace("\\\n", " "))[3:]
    argv[argv.index("--model") + 1] = "qwen3"
    assert cli.main(argv + FEW_STEPS) == 0, capsys.readouterr().err
    record = json.loads((recipe_folder / "m.jsonl").read_text().splitlines()[-1])
    rewards = {key for key in record if key.startswith("rewards/") and key.endswith("/mean")}
    assert rewards == {"rewards/exact/mean"}  # the built-ins are not summed in
    assert record["completions/mean_length"] <= int(argv[argv.index("--max-new-tokens") + 1])
    hf.load_pretrained(recipe_folder / "runs" / "grpo_export")  # the export loads


def test_max_new_tokens_defaults_to_the_task_or_trls_and_a_run_keeps_its_recorded_value(capsys):
    preset = cli.config_from_argv(["grpo"])
    assert (preset.method.max_new_tokens, preset.method.rewards) == (8, "exact_match,char_match")
    real = cli.config_from_argv(["grpo", "--model", str(HF / "qwen3"), "--reward-funcs", "my_rewards:exact"])
    assert (real.method.max_new_tokens, real.method.rewards) == (64, "")  # half of the fixture's 128 positions
    assert "--max-new-tokens default: 64 tokens a completion (TRL's 256, halved to fit 128 positions" in \
        capsys.readouterr().out
    resumed, adopted = real.with_recorded({"max_new_tokens": 8, "rewards": "exact_match,char_match"})
    assert (resumed.method.max_new_tokens, resumed.method.rewards) == (8, "exact_match,char_match")
    assert adopted == {"max_new_tokens": (64, 8), "rewards": ("", "exact_match,char_match")}
    given = cli.config_from_argv(["grpo", "--model", str(HF / "qwen3"), "--max-new-tokens", "16"])
    assert given.with_recorded({"max_new_tokens": 8})[0].method.max_new_tokens == 16  # a flag is not a default


def test_the_built_in_rewards_on_data_without_their_column_are_named_with_the_fix(recipe_folder, capsys):
    assert cli.main(["grpo", "--model", "qwen3", "--train-file", "prompts.jsonl", *FEW_STEPS]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --rewards: a reward function raised ValueError: exact_match needs the data set's "
                          "'completion' column") and "name yours so, or pass your own with --reward-funcs" in err
    assert len(err.splitlines()) == 1 and not (recipe_folder / "m.jsonl").exists()
