"""The command on each Hugging Face fixture (llama, llama_tied, qwen2, qwen3) with data in
TRL's formats: SFT's step-1 loss is `sft.objective` on `hf.load_pretrained` and the rendered
batch, DPO starts at ln 2, and GRPO logs a reward from a temporary module (issue 26)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax.numpy as jnp
import pytest

from tunix_nb import cli, compare, data, hf, sft, user_data
from tunix_nb.tokenizer import HFTokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = ["llama", "llama_tied", "qwen2", "qwen3"]
QUESTIONS = [(f"What is {a}+{b}?", str(a + b)) for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


# Both sides compute in float32 at float32's matmul precision; what the backend adds is one
# log-softmax's exp and log (1.07e-6 on a CPU, 5.0e-4 on a TPU, whose float32 log is off by
# up to 3,103 eps). On the chip, "auto" (a bfloat16 step) was 1.3e-4 to 5.0e-4 off the float32
# loss at these fixtures: hence --compute-dtype float32, like with like.
LOG_SOFTMAX_RTOL = compare.float32_bound(1, transcendentals=compare.log_softmax_transcendentals())


def _run(argv) -> int:
    try:
        return cli.main([str(a) for a in argv])
    except SystemExit as exit_:
        return exit_.code


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _last_metrics(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_sft_step_one_loss_is_the_objective_on_the_loaded_model(name, tmp_path):
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QUESTIONS]
    train = _jsonl(tmp_path / "chats.jsonl", rows)
    assert _run(["sft", "--model", FIXTURES / name, "--train-file", train, "--steps", 1, "--batch-size", 4,
                 "--compute-dtype", "float32", "--metrics-file", tmp_path / "m.jsonl"]) == 0
    graphdef, params, _ = hf.load_pretrained(FIXTURES / name, dtype="float32")
    arrays = user_data.sft_arrays(train, HFTokenizer.from_dir(FIXTURES / name)).arrays
    batch = data.batch_at(arrays, 0, 4, seed=0)
    nll_sum, count, _ = sft.objective(graphdef, compute_dtype=jnp.float32)(params, batch)
    assert _last_metrics(tmp_path / "m.jsonl")["loss"] == pytest.approx(float(nll_sum / count), rel=LOG_SOFTMAX_RTOL)


@pytest.mark.parametrize("name", NAMES)
def test_dpo_starts_at_ln2(name, tmp_path):
    rows = [{"prompt": q, "chosen": a, "rejected": a + "0"} for q, a in QUESTIONS]
    train = _jsonl(tmp_path / "pairs.jsonl", rows)
    assert _run(["dpo", "--model", FIXTURES / name, "--train-file", train, "--steps", 1, "--batch-size", 4,
                 "--compute-dtype", "float32", "--metrics-file", tmp_path / "m.jsonl"]) == 0
    assert _last_metrics(tmp_path / "m.jsonl")["loss"] == pytest.approx(math.log(2), abs=LOG_SOFTMAX_RTOL)


@pytest.mark.parametrize("name", NAMES)
def test_grpo_logs_a_reward_from_your_module(name, tmp_path, monkeypatch):
    (tmp_path / "fixture_rewards.py").write_text(
        "def says_answer(prompts, completions, answer, **_):\n"
        "    return [float(a in c) for c, a in zip(completions, answer)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": q, "answer": a} for q, a in QUESTIONS])
    assert _run(["grpo", "--model", FIXTURES / name, "--train-file", train, "--rewards", "",
                 "--reward-funcs", "fixture_rewards:says_answer", "--steps", 1, "--batch-size", 2, "--group-size", 2,
                 "--max-new-tokens", 4, "--metrics-file", tmp_path / "m.jsonl"]) == 0
    record = _last_metrics(tmp_path / "m.jsonl")
    assert 0 <= record["rewards/says_answer/mean"] <= 1
