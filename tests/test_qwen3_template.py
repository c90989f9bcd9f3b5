"""Qwen3's real chat template (tests/fixtures/hf/qwen3_template, from Qwen/Qwen3-0.6B) and
--chat-template-kwargs: the rows equal transformers' ids, and the loss mask with thinking on
(Qwen3's default) and off is the one docs/cli.md states: the assistant's turn as the template
renders it after the generation prompt, up to and including its <|im_end|>."""

import json
import shutil
from pathlib import Path

import pytest

from tunix_nb import checkpoint, cli, user_data
from tunix_nb.data import DataError
from tunix_nb.tokenizer import HFTokenizer

HF = Path(__file__).resolve().parent / "fixtures" / "hf"
QWEN3 = HFTokenizer.from_dir(HF / "qwen3_template")
RECORDED = json.loads((HF / "chat_templates.json").read_text())  # by record_chat_templates.py, with transformers
CONVERSATION = RECORDED["conversation"]  # user hi, assistant yo, user add 2 3, assistant 5
EXCHANGE = CONVERSATION[2:]
MODES = {"thinking_default": None, "thinking_off": {"enable_thinking": False}}
# what carries loss in the exchange's row, by the rule in docs/cli.md
LOSS_TEXT = {"thinking_default": "<think>\n\n</think>\n\n5<|im_end|>", "thinking_off": "5<|im_end|>"}


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _text(ids) -> str:
    return QWEN3.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _loss_text(arrays: dict, i: int = 0) -> str:
    return _text(t for t, m in zip(arrays["targets"][i], arrays["loss_mask"][i]) if m)


def test_the_fixture_is_qwen3s_template_and_not_chatml():
    assert "enable_thinking is defined and enable_thinking is false" in QWEN3.chat_template
    assert "ns.last_query_index" in QWEN3.chat_template


@pytest.mark.parametrize("mode", MODES)
def test_rows_and_prompts_equal_transformers_ids(tmp_path, mode):
    recorded = RECORDED["qwen3_template"][mode]
    out = user_data.sft_arrays(_rows(tmp_path / "m.jsonl", [{"messages": EXCHANGE}]), QWEN3,
                               template_kwargs=MODES[mode])
    row = out.arrays["inputs"][0].tolist() + [int(out.arrays["targets"][0, -1])]
    assert row == recorded["exchange_ids"]
    table = user_data.Table("t", ["prompt"], [{"prompt": EXCHANGE[:1]}], ["t 1"])
    prompt = user_data.prompt_arrays(table, QWEN3, template_kwargs=MODES[mode]).arrays["prompt_tokens"][0]
    assert prompt.tolist() == recorded["exchange_prompt_ids"]


@pytest.mark.parametrize("mode", MODES)
def test_the_loss_covers_what_follows_the_generation_prompt(tmp_path, mode):
    """Thinking on: the empty <think> block the template writes into the last assistant turn is
    the model's to write, so it gets loss. Off: the generation prompt holds it, so it is prompt."""
    out = user_data.sft_arrays(_rows(tmp_path / "m.jsonl", [{"messages": EXCHANGE}]), QWEN3,
                               template_kwargs=MODES[mode])
    assert _loss_text(out.arrays) == LOSS_TEXT[mode]


@pytest.mark.parametrize("mode", MODES)
def test_several_assistant_turns_name_the_fix_and_prompt_completion_trains_the_last(tmp_path, mode):
    """Qwen3 writes <think> only into turns after the last user message, so a turn renders one way
    as the last message and another once a user follows it: one row per assistant turn."""
    with pytest.raises(DataError, match=r"m\.jsonl line 1: the chat template renders .* Qwen3's template does this "
                                        r"to a row with several assistant turns .* make one row per assistant turn, "
                                        r"as prompt \(the turns before it\) and completion \(that turn\)"):
        user_data.sft_arrays(_rows(tmp_path / "m.jsonl", [{"messages": CONVERSATION}]), QWEN3,
                             template_kwargs=MODES[mode])
    rows = [{"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]}]
    out = user_data.sft_arrays(_rows(tmp_path / "pc.jsonl", rows), QWEN3, template_kwargs=MODES[mode])
    row = out.arrays["inputs"][0].tolist() + [int(out.arrays["targets"][0, -1])]
    assert row == RECORDED["qwen3_template"][mode]["conversation_ids"]
    assert _loss_text(out.arrays) == LOSS_TEXT[mode]  # the earlier reply, history, has none


def test_reasoning_is_trained_with_thinking_on(tmp_path):
    reply = {"role": "assistant", "content": "<think>\n2 and 3 make 5\n</think>\n\n5"}
    out = user_data.sft_arrays(_rows(tmp_path / "m.jsonl", [{"messages": [EXCHANGE[0], reply]}]), QWEN3)
    assert _loss_text(out.arrays) == "<think>\n2 and 3 make 5\n</think>\n\n5<|im_end|>"


# ---------------------------------------------------------------- through the command


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> Path:
    """The qwen3 fixture's weights with Qwen3's real template."""
    folder = tmp_path_factory.mktemp("qwen3_template_model") / "model"
    shutil.copytree(HF / "qwen3", folder)
    shutil.copy(HF / "qwen3_template" / "tokenizer_config.json", folder / "tokenizer_config.json")
    return folder


@pytest.mark.parametrize("value, message", [
    ("{enable_thinking: false}", "is not valid JSON (Expecting property name enclosed in double quotes at column 2); "
                                 "give a JSON object, e.g. '{\"enable_thinking\": false}'"),
    ("[false]", "is a JSON list, not an object; give a JSON object"),
])
def test_invalid_chat_template_kwargs_are_refused_in_one_line(capsys, value, message):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["sft", "--model", "tiny", "--train-file", "x.jsonl", "--chat-template-kwargs", value])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument --chat-template-kwargs: {value!r} {message}" in err


def test_chat_template_kwargs_need_a_train_file(capsys):
    with pytest.raises(SystemExit):
        cli.main(["sft", "--model", "tiny", "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert "--chat-template-kwargs applies to --train-file's conversations" in capsys.readouterr().err


def test_the_command_renders_rows_with_the_kwargs_and_records_them(qwen3_model, tmp_path, monkeypatch, capsys):
    built = []
    encode = user_data.ENCODERS["sft"]
    monkeypatch.setitem(user_data.ENCODERS, "sft", lambda *a, **k: built.append(encode(*a, **k)) or built[-1])
    train = _rows(tmp_path / "train.jsonl", [{"messages": EXCHANGE}] * 8)
    argv = ["sft", "--model", str(qwen3_model), "--train-file", str(train), "--batch-size", "8", "--steps", "1",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--chat-template-kwargs", '{"enable_thinking": false}']
    assert cli.main(argv) == 0
    assert _loss_text(built[0].arrays) == LOSS_TEXT["thinking_off"]
    assert checkpoint.load_meta(tmp_path / "ckpt")["config"]["chat_template_kwargs"] == '{"enable_thinking": false}'
    argv[argv.index("--steps") + 1] = "2"  # a resume that renders the rows otherwise is another run
    assert cli.main(argv[:-2]) == 2
    assert "chat_template_kwargs" in capsys.readouterr().err


def test_a_tokenizer_without_a_template_takes_no_kwargs(tmp_path, capsys):
    train = _rows(tmp_path / "train.jsonl", [{"prompt": "add 2 3", "completion": " 5"}] * 8)
    argv = ["sft", "--model", "tiny", "--train-file", str(train), "--chat-template-kwargs", '{"x": 1}']
    assert cli.main(argv) == 2
    assert '--chat-template-kwargs {"x": 1}: the model\'s tokenizer has no chat template' in capsys.readouterr().err
