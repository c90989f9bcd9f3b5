"""The training command on your own model and data: --train-file/--eval-file in TRL's formats,
--max-length, --vocab-chunk (and its automatic default), --export-hf and --export-adapter (issue 26's whole path, on the
tiny Qwen3 fixture), and the errors that name the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from tunix_nb import checkpoint, cli, generate, hf, peft_adapter

QWEN3 = str(Path(__file__).parent / "fixtures" / "hf" / "qwen3")


def _run(argv) -> int:
    try:
        return cli.main([str(a) for a in argv])
    except SystemExit as exit_:  # argparse's usage errors
        return exit_.code


def _run_where_the_kill_runs(argv) -> int:
    """A run compared bit for bit with a killed one: in this process, or, where this process
    holds a chip, in a CPU child as the killed run is (`preempt.run_beside`)."""
    from tunix_nb import devices, preempt

    if not devices.holds_accelerator():
        return _run(argv)
    done = preempt.run_beside(argv)
    print(done.stdout[-2000:], done.stderr[-2000:])
    return done.returncode


def _messages(path: Path, pairs) -> Path:
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    pairs = [(f"What is {a}+{b}?", str(a + b)) for a in range(6) for b in range(4)]
    return _messages(folder / "train.jsonl", pairs[:16]), _messages(folder / "eval.jsonl", pairs[16:])


@pytest.fixture(scope="module")
def lora_run(chat_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train, eval_ = chat_files
    argv = ["sft", "--model", QWEN3, "--train-file", train, "--eval-file", eval_, "--max-length", 40,
            "--lora-rank", 4, "--steps", 4, "--batch-size", 8, "--eval-every", 2, "--vocab-chunk", 64,
            "--metrics-file", out / "metrics.jsonl", "--ckpt-dir", out / "ckpt", "--save-every", 2,
            "--export-hf", out / "hf", "--export-adapter", out / "adapter",
            "--compute-dtype", "float32"]  # "auto" keeps a bfloat16 base on a chip: merged would round BA away
    assert _run(argv) == 0
    return out, argv


def test_your_data_trains_the_adapters_through_the_chunked_loss(lora_run):
    out, _ = lora_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 for r in records)  # the adapters get gradients through vocab_chunks
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]


def test_the_run_records_the_data_by_content(lora_run, chat_files):
    out, _ = lora_run
    config = checkpoint.load_meta(out / "ckpt")["config"]
    assert config["data_sha256"] == cli.data_hash(str(chat_files[0])) and config["max_length"] == 40


def test_resume_refuses_other_data(lora_run, chat_files, tmp_path, capsys):
    out, argv = lora_run
    changed = _messages(tmp_path / "train.jsonl", [("What is 9+9?", "18")] * 16)
    argv = [changed if a == chat_files[0] else a for a in argv]
    argv[argv.index("--steps") + 1] = 6
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert "data_sha256" in err and "Nothing was changed" in err


def test_the_exported_folder_is_the_merged_model_with_the_tokenizer(lora_run):
    out, _ = lora_run
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (out / "hf").iterdir()}
    graphdef, params, config = hf.load_pretrained(out / "hf")
    source = json.loads((Path(QWEN3) / "config.json").read_text())
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["max_position_embeddings"] == source["max_position_embeddings"]
    base_graphdef, base, _ = hf.load_pretrained(QWEN3)
    lora_graphdef, adapters, _, alpha = peft_adapter.load_adapter(out / "adapter", base_graphdef, base)
    from tunix_nb import lora, model

    tokens = np.arange(3, 19, dtype=np.int32).reshape(2, 8)
    merged = model.apply(graphdef, params, tokens)
    adapted = model.apply(lora_graphdef, lora.combine(adapters, lora.apply(base_graphdef, base, rank=4)[2]), tokens)
    np.testing.assert_allclose(adapted, merged, atol=1e-4)
    assert generate.complete(out / "hf", "What is 2+2?", max_new_tokens=3) is not None


@pytest.fixture(scope="module")
def big_vocabulary_model(tmp_path_factory):
    """The Qwen3 fixture's architecture with a real tokenizer's vocabulary size (16,384
    entries, more than one auto chunk): fresh weights, the fixture's tokenizer files."""
    import dataclasses
    import shutil

    from tunix_nb import model

    config = dataclasses.replace(hf.model_config(hf.read_config(QWEN3)), vocab_size=16384)
    graphdef, params = model.split(model.make_model(config, seed=0))
    out = tmp_path_factory.mktemp("big_vocabulary")
    hf.save_pretrained(out, graphdef, params, config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(QWEN3) / name, out / name)
    return str(out)


def test_vocab_chunk_auto_chunks_a_real_vocabulary_and_keeps_the_toys_full_logits(big_vocabulary_model, capsys):
    """--vocab-chunk's default, auto: chunks of 8192 above 8192 entries (said on stdout); the
    presets and the fixture (259 and 320 entries) keep today's full-logits path, silently."""
    from tunix_nb.train.config import AUTO_VOCAB_CHUNK

    assert cli.config_from_argv(["sft", "--model", big_vocabulary_model]).memory.vocab_chunk == AUTO_VOCAB_CHUNK
    assert "--vocab-chunk auto: 8192 (the vocabulary's 16,384 entries" in capsys.readouterr().out
    for argv in (["sft", "--model", "tiny"], ["sft", "--model", QWEN3], ["distill", "--packing"]):
        assert cli.config_from_argv(argv).memory.vocab_chunk is None
        assert "--vocab-chunk" not in capsys.readouterr().out
    assert cli.config_from_argv(["sft", "--model", big_vocabulary_model, "--vocab-chunk", "none"]).memory.vocab_chunk \
        is None
    assert cli.config_from_argv(["sft", "--model", big_vocabulary_model, "--vocab-chunk", "1000"]).memory.vocab_chunk \
        == 1000
    with_positions = cli.config_from_argv(["sft", "--model", "tiny", "--seq-chunk", "8"]).memory
    assert (with_positions.vocab_chunk, with_positions.seq_chunk) == (AUTO_VOCAB_CHUNK, 8)


def test_the_automatic_chunks_train_as_the_full_logits_do(big_vocabulary_model, chat_files, tmp_path):
    """The command on a 16,384-entry vocabulary: the default (two chunks of 8192) and
    --vocab-chunk none give the same losses and gradient norms, step by step."""
    metrics = {}
    for name, extra in (("auto", []), ("none", ["--vocab-chunk", "none"])):
        argv = ["sft", "--model", big_vocabulary_model, "--train-file", chat_files[0], "--max-length", 40,
                "--steps", 3, "--batch-size", 8, "--learning-rate", "1e-2", "--compute-dtype", "float32",
                "--metrics-file", tmp_path / f"{name}.jsonl", *extra]
        assert _run(argv) == 0
        metrics[name] = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    for chunked, full in zip(metrics["auto"], metrics["none"], strict=True):
        np.testing.assert_allclose(chunked["loss"], full["loss"], rtol=1e-5)
        np.testing.assert_allclose(chunked["grad_norm"], full["grad_norm"], rtol=1e-5)


@pytest.mark.parametrize("extra, message", [
    (["--eval-file", "x.jsonl"], "--eval-file goes with --train-file"),
    (["--max-length", "8"], "--max-length applies to --train-file"),
    (["--export-adapter", "out"], "--export-adapter writes LoRA adapters"),
    (["--vocab-chunk", "none", "--seq-chunk", "8"], "--seq-chunk needs the chunked path"),
    (["--vocab-chunk", "big"], "give a number of vocabulary entries such as 8192, auto or none"),
    (["--export-dtype", "bfloat16"], "add --export-hf"),
])
def test_flag_combinations_are_refused_with_the_fix(extra, message, capsys):
    assert _run(["sft", "--model", "tiny", "--steps", "2", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_row_that_cannot_fit_names_its_line(chat_files, capsys):
    assert _run(["sft", "--model", QWEN3, "--train-file", chat_files[0], "--max-length", 5, "--steps", 2,
                 "--batch-size", 8]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl line 1" in err and "raise max_length to at least" in err


def test_grpo_reads_prompts_and_passes_the_other_columns_to_your_reward(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def matches_answer(prompts, completions, answer, **_):\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": f"add {a}+{a}=", "answer": str(2 * a)} for a in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = tmp_path / "m.jsonl"
    assert _run(["grpo", "--train-file", tmp_path / "prompts.jsonl", "--reward-funcs", "my_rewards:matches_answer",
                 "--rewards", "", "--steps", 2, "--batch-size", 4, "--group-size", 2,
                 "--metrics-file", metrics]) == 0
    record = json.loads(metrics.read_text().splitlines()[-1])
    assert "rewards/matches_answer/mean" in record and 0 <= record["rewards/matches_answer/mean"] <= 1


def test_grpo_hands_conversational_completions_to_your_reward_as_trl_does(tmp_path, monkeypatch):
    """Conversational prompts: each completion reaches the reward as [{"role": "assistant", "content": ...}]."""
    (tmp_path / "chat_rewards.py").write_text(
        "def short_reply(prompts, completions, **_):\n"
        "    assert all(isinstance(p, list) and p[-1]['role'] == 'user' for p in prompts), prompts[:1]\n"
        "    assert all(len(c) == 1 and c[0]['role'] == 'assistant' for c in completions), completions[:1]\n"
        "    return [float(len(c[0]['content']) < 20) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{a}?"}]} for a in range(8)]
    (tmp_path / "chat_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = tmp_path / "m.jsonl"
    assert _run(["grpo", "--model", QWEN3, "--train-file", tmp_path / "chat_prompts.jsonl",
                 "--reward-funcs", "chat_rewards:short_reply", "--rewards", "", "--steps", 1, "--batch-size", 4,
                 "--group-size", 2, "--max-new-tokens", 8, "--metrics-file", metrics]) == 0
    assert 0 <= json.loads(metrics.read_text().splitlines()[-1])["rewards/short_reply/mean"] <= 1


@pytest.mark.parametrize("lora_flags", [[], ["--lora-rank", "4"]], ids=["full", "lora"])
def test_killed_between_saves_resumes_bitwise_on_your_model_and_data(chat_files, tmp_path, lora_flags):
    from tunix_nb import compare, preempt

    train, _ = chat_files
    base = ["sft", "--model", QWEN3, "--train-file", str(train), "--steps", "6", "--batch-size", "4",
            "--save-every", "2", "--sync-save", *lora_flags]
    whole = tmp_path / "whole"
    run = _run_where_the_kill_runs
    assert run([*base, "--ckpt-dir", whole, "--metrics-file", whole / "m.jsonl"]) == 0
    ckpt, metrics = tmp_path / "killed", tmp_path / "killed" / "m.jsonl"
    ckpt.mkdir()
    killed = preempt.run_and_kill([*base, "--ckpt-dir", str(ckpt), "--metrics-file", str(metrics)],
                                  ckpt_dir=ckpt, metrics_file=metrics, when="between_saves", after_step=2,
                                  timeout=300)
    assert killed["killed"] and killed["step"] < 6, killed
    assert run([*base, "--ckpt-dir", ckpt, "--metrics-file", metrics]) == 0
    assert compare.bitwise_equal(checkpoint.load_params(ckpt), checkpoint.load_params(whole))
    assert metrics.read_text() == (whole / "m.jsonl").read_text()


def test_exported_files_are_readable_by_other_users(lora_run):
    """A server running as another user reads the exports: the weights as every other file
    (safetensors alone would write them 0600)."""
    out, _ = lora_run
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.relative_to(out).as_posix(): oct(p.stat().st_mode & 0o777)
             for folder in ("hf", "adapter") for p in (out / folder).rglob("*") if p.is_file()}
    assert {"hf/model.safetensors", "adapter/adapter_model.safetensors"} <= set(modes)
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
