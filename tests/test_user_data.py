"""tunix_nb.user_data: TRL's dataset formats -> the kit's arrays (masks, truncation, errors).

Small files are written to tmp_path in each format; the expected masked tokens are built
by hand from the pieces of each row (the content's ids plus the end-of-turn id), not by the
code under test. The Hugging Face tokenizers are the fixtures in tests/fixtures/hf: `qwen3`
(ChatML in tokenizer_config.json, no bos) and `llama3_chat` (a hand-written Llama-3-style
`chat_template.jinja` that writes the bos itself).
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tunix_nb import data, user_data
from tunix_nb.data import DataError
from tunix_nb.tokenizer import ByteTokenizer, HFTokenizer

HF = Path(__file__).resolve().parent / "fixtures" / "hf"
byte = ByteTokenizer()
chatml = HFTokenizer.from_dir(HF / "qwen3")
llama3 = HFTokenizer.from_dir(HF / "llama3_chat")
SFT_KEYS = ("inputs", "targets", "loss_mask", "attention_mask")


def write(path: Path, rows: list[dict]) -> Path:
    """rows as .jsonl, .json (a list of objects) or .parquet, by the path's suffix."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def masked(arrays: dict, i: int, prefix: str = "") -> list[int]:
    """The targets of row i that carry loss."""
    return [int(t) for t, m in zip(arrays[prefix + "targets"][i], arrays[prefix + "loss_mask"][i]) if m]


def full_row(arrays: dict, i: int, prefix: str = "") -> list[int]:
    """Row i as stored: its inputs, then its last target (inputs and targets are shifted copies)."""
    return [int(t) for t in arrays[prefix + "inputs"][i]] + [int(arrays[prefix + "targets"][i][-1])]


def assert_row(arrays: dict, i: int, ids: list[int], pad_id: int, prefix: str = "") -> None:
    """Row i is `ids` right-padded with pad_id, and attends to exactly the positions of `ids`."""
    width = arrays[prefix + "inputs"].shape[1]
    assert full_row(arrays, i, prefix) == ids + [pad_id] * (width + 1 - len(ids))
    assert arrays[prefix + "attention_mask"][i].tolist() == [int(t < len(ids)) for t in range(width)]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------- standard rows


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_prompt_completion_each_file_type_gives_the_shipped_layout(tmp_path, suffix):
    rows = [{"prompt": "add 1+2=", "completion": "3"}, {"prompt": "rev abc=", "completion": "cba"}]
    out = user_data.sft_arrays(write(tmp_path / f"d{suffix}", rows), byte, seq_len=data.DEFAULT_SEQ_LEN)
    expected = data.sft_arrays(rows, byte, data.DEFAULT_SEQ_LEN)
    assert (out.format, out.conversational, out.n_cut) == ("prompt_completion", False, 0)
    for k in SFT_KEYS:
        assert out.arrays[k].dtype == expected[k].dtype and np.array_equal(out.arrays[k], expected[k]), k
    # by hand: loss on the completion's bytes and the eos, nothing else
    assert masked(out.arrays, 1) == [ord(c) + 3 for c in "cba"] + [byte.eos_id]


def test_default_seq_len_is_the_longest_row():
    table = user_data.Table("t", ["prompt", "completion"], [{"prompt": "ab", "completion": "c"},
                                                             {"prompt": "abcd", "completion": "ef"}], ["t 1", "t 2"])
    out = user_data.sft_arrays(table, byte)
    assert out.arrays["inputs"].shape == (2, 1 + 4 + 2 + 1 - 1)
    assert_row(out.arrays, 1, [byte.bos_id, *byte.encode("abcdef"), byte.eos_id], byte.pad_id)


def test_text_rows_have_loss_on_every_token_and_lose_their_end(tmp_path):
    path = write(tmp_path / "lm.jsonl", [{"text": "The sky is blue."}, {"text": "Hi."}])
    out = user_data.sft_arrays(path, byte)
    assert out.format == "language_modeling"
    assert masked(out.arrays, 0) == byte.encode("The sky is blue.") + [byte.eos_id]
    cut = user_data.sft_arrays(path, byte, max_length=6)
    assert cut.n_cut == 1  # "Hi." fits: bos + 3 + eos = 5
    assert_row(cut.arrays, 0, [byte.bos_id, *byte.encode("The s")], byte.pad_id)  # the start kept, eos gone
    assert masked(cut.arrays, 1) == byte.encode("Hi.") + [byte.eos_id]


# ---------------------------------------------------------------- conversations


CHAT = [user("hi"), assistant("yo"), user("add 2 3"), assistant("5")]


def chatml_text(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def test_messages_loss_covers_every_assistant_turn_and_its_end_of_turn(tmp_path):
    out = user_data.sft_arrays(write(tmp_path / "m.jsonl", [{"messages": CHAT}]), chatml)
    im_end = chatml.eos_id
    assert (out.format, out.conversational) == ("messages", True)
    assert_row(out.arrays, 0, chatml.encode(chatml_text(CHAT)), chatml.pad_id)  # the template, once, no kit bos
    assert masked(out.arrays, 0) == chatml.encode("yo") + [im_end] + chatml.encode("5") + [im_end]
    # ChatML's newline after the last <|im_end|> is in the row, without loss
    assert out.arrays["targets"][0, -1] == chatml.encode("\n")[0] and out.arrays["loss_mask"][0, -1] == 0


def test_conversational_prompt_completion_with_a_template_that_writes_the_bos(tmp_path):
    rows = [{"prompt": [user("add 2 3")], "completion": [assistant("5")]}]
    out = user_data.sft_arrays(write(tmp_path / "pc.jsonl", rows), llama3)
    row = full_row(out.arrays, 0)
    assert row[0] == llama3.bos_id and row.count(llama3.bos_id) == 1  # one bos: the template's
    text = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nadd 2 3<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n5<|eot_id|>")
    assert_row(out.arrays, 0, llama3.encode(text), llama3.pad_id)
    assert masked(out.arrays, 0) == llama3.encode("5") + [llama3.tokenizer.token_to_id("<|eot_id|>")]


def test_chat_template_jinja_is_read_and_wins_over_the_config(tmp_path):
    assert llama3.chat_template == (HF / "llama3_chat" / "chat_template.jinja").read_text()
    folder = tmp_path / "tok"
    shutil.copytree(HF / "qwen3", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    tok = HFTokenizer.from_dir(folder)
    assert tok.apply_chat_template([user("a"), assistant("b")]) == "a|b|"


def test_named_templates_in_the_config_and_generation_blocks(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(HF / "qwen3", folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # `{{ '\\n' }}`, not a newline, after a block tag: trim_blocks (as in transformers) eats that newline
    marked = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}<|im_start|>assistant\n"
              "{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}<|im_start|>{{ m['role'] }}\n"
              "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    config["chat_template"] = [{"name": "tool_use", "template": "unused"}, {"name": "default", "template": marked}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer.from_dir(folder)
    assert tok.chat_template == marked
    # the {% generation %} marker renders its body: the same text and masks as the plain ChatML template
    out = user_data.sft_arrays(write(tmp_path / "m.jsonl", [{"messages": CHAT}]), tok)
    assert_row(out.arrays, 0, chatml.encode(chatml_text(CHAT)), tok.pad_id)
    assert masked(out.arrays, 0) == chatml.encode("yo") + [tok.eos_id] + chatml.encode("5") + [tok.eos_id]


RECORDED = json.loads((HF / "chat_templates.json").read_text())  # by record_chat_templates.py, with transformers


@pytest.mark.parametrize("name, tok", [("qwen3", chatml), ("llama3_chat", llama3)])
def test_rows_and_prompts_are_transformers_ids(tmp_path, name, tok):
    expected = RECORDED[name]["conversation_ids"]
    out = user_data.sft_arrays(write(tmp_path / "m.jsonl", [{"messages": RECORDED["conversation"]}]), tok)
    assert_row(out.arrays, 0, expected, tok.pad_id)
    if name == "llama3_chat":  # the template writes the bos and the kit adds none: exactly one
        assert expected[0] == tok.bos_id and expected.count(tok.bos_id) == 1
    table = user_data.Table("t", ["prompt"], [{"prompt": RECORDED["conversation"][:1]}], ["t 1"])
    assert user_data.prompt_arrays(table, tok).arrays["prompt_tokens"][0].tolist() == \
        RECORDED[name]["first_turn_prompt_ids"]


def test_loss_mask_equals_transformers_assistant_masks(tmp_path):
    tok = HFTokenizer.from_dir(HF / "qwen3")
    tok.chat_template = RECORDED["marked_chatml"]  # {% generation %} around each reply and its <|im_end|>
    out = user_data.sft_arrays(write(tmp_path / "m.jsonl", [{"messages": RECORDED["conversation"]}]), tok)
    assert_row(out.arrays, 0, RECORDED["marked_chatml_ids"], tok.pad_id)
    loss_at = [0] + out.arrays["loss_mask"][0].astype(int).tolist()  # row position p: targets[p - 1]
    assert loss_at[:len(RECORDED["marked_chatml_ids"])] == RECORDED["marked_chatml_assistant_masks"]


def test_prompt_rows_are_transformers_ids_left_padded():
    reference = json.loads((HF / "qwen3" / "reference.json").read_text())["tokenizer"]
    messages = reference["chat_template_messages"]
    table = user_data.Table("t", ["prompt", "task"], [{"prompt": messages, "task": "add"},
                                                       {"prompt": "add 2 3", "task": "add"}], ["t 1", "t 2"])
    out = user_data.prompt_arrays(table, chatml)
    ids = reference["chat_template_ids"]  # recorded from transformers' apply_chat_template
    width = len(ids)
    assert out.arrays["prompt_tokens"].shape == (2, width)
    assert out.arrays["prompt_tokens"][0].tolist() == ids and out.arrays["prompt_mask"][0].all()
    plain = [chatml.bos_id, *chatml.encode("add 2 3")]  # standard prompts: the kit's bos, as data.prompt_arrays
    assert out.arrays["prompt_tokens"][1, width - len(plain):].tolist() == plain
    assert out.arrays["prompt_mask"][1].tolist() == [0] * (width - len(plain)) + [1] * len(plain)
    assert out.examples == table.rows and out.arrays["index"].tolist() == [0, 1]


def test_prompt_arrays_equal_grpo_prompt_rows_on_standard_prompts(tmp_path):
    from tunix_nb import grpo

    rows = [{"prompt": "add 1+2=", "completion": "3", "task": "add"}, {"prompt": "rev ab=", "completion": "ba",
                                                                         "task": "reverse"}]
    out = user_data.prompt_arrays(write(tmp_path / "g.parquet", rows), byte)
    expected = grpo.prompt_rows(rows, byte, prompt_len=out.arrays["prompt_tokens"].shape[1])
    assert sorted(out.arrays) == sorted(expected)
    for k in expected:
        assert out.arrays[k].dtype == expected[k].dtype and np.array_equal(out.arrays[k], expected[k]), k
    assert out.examples == rows  # every column kept for the reward functions


# ---------------------------------------------------------------- preferences


def test_preferences_standard_equal_data_preference_arrays(tmp_path):
    rows = data.load_preferences()[:40]
    path = write(tmp_path / "p.jsonl", [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    out = user_data.preference_arrays(path, byte, seq_len=data.DEFAULT_SEQ_LEN)
    expected = data.preference_arrays(rows, byte, data.DEFAULT_SEQ_LEN)
    assert sorted(out.arrays) == sorted(expected) and out.format == "preference"
    for k in expected:
        assert out.arrays[k].dtype == expected[k].dtype and np.array_equal(out.arrays[k], expected[k]), k


def test_implicit_prompt_standard_and_conversational(tmp_path):
    plain = user_data.preference_arrays(
        write(tmp_path / "i.jsonl", [{"chosen": "The sky is blue.", "rejected": "The sky is green."}]), byte)
    assert plain.format == "implicit_preference"
    assert full_row(plain.arrays, 0, "chosen_")[:1 + len("The sky is")] == [byte.bos_id, *byte.encode("The sky is")]
    assert masked(plain.arrays, 0, "chosen_") == byte.encode(" blue.") + [byte.eos_id]
    assert masked(plain.arrays, 0, "rejected_") == byte.encode(" green.") + [byte.eos_id]
    chat = [{"chosen": [user("2+2?"), assistant("4")], "rejected": [user("2+2?"), assistant("5")]}]
    conv = user_data.preference_arrays(write(tmp_path / "c.json", chat), chatml)
    assert conv.conversational
    assert masked(conv.arrays, 0, "chosen_") == chatml.encode("4") + [chatml.eos_id]
    assert masked(conv.arrays, 0, "rejected_") == chatml.encode("5") + [chatml.eos_id]
    assert_row(conv.arrays, 0, chatml.encode(chatml_text(chat[0]["chosen"])), chatml.pad_id, "chosen_")
    explicit = [{"prompt": [user("2+2?")], "chosen": [assistant("4")], "rejected": [assistant("5")]}]
    same = user_data.preference_arrays(write(tmp_path / "e.parquet", explicit), chatml)
    assert same.format == "preference" and all(np.array_equal(same.arrays[k], conv.arrays[k]) for k in conv.arrays)


# ---------------------------------------------------------------- truncation


def test_a_long_prompt_loses_its_beginning_and_the_count_is_returned(tmp_path):
    rows = [{"prompt": "abcdefgh", "completion": "xy"}, {"prompt": "ab", "completion": "xy"}]
    out = user_data.sft_arrays(write(tmp_path / "t.jsonl", rows), byte, max_length=7)
    assert out.n_cut == 1
    assert_row(out.arrays, 0, [byte.bos_id, *byte.encode("fghxy"), byte.eos_id], byte.pad_id)  # "abcde" gone
    assert masked(out.arrays, 0) == byte.encode("xy") + [byte.eos_id]
    assert_row(out.arrays, 1, [byte.bos_id, *byte.encode("abxy"), byte.eos_id], byte.pad_id)


def test_truncation_keeps_the_assistant_header_of_a_conversation(tmp_path):
    rows = [{"messages": [user("a long question"), assistant("ok")]}]
    full = chatml.encode(chatml_text(rows[0]["messages"]))
    tail = chatml.encode("<|im_start|>assistant\nok<|im_end|>\n")
    out = user_data.sft_arrays(write(tmp_path / "t.jsonl", rows), chatml, max_length=len(tail) + 2)
    assert out.n_cut == 1
    assert_row(out.arrays, 0, full[-(len(tail) + 2):], chatml.pad_id)
    assert masked(out.arrays, 0) == chatml.encode("ok") + [chatml.eos_id]
    with pytest.raises(DataError, match=rf"t\.jsonl line 1: the row needs {len(tail)} tokens .* max_length to at "
                                        rf"least {len(tail)}"):
        user_data.sft_arrays(tmp_path / "t.jsonl", chatml, max_length=len(tail) - 1)


def test_preference_prompt_is_cut_alike_on_both_sides(tmp_path):
    rows = [{"prompt": "abcdef", "chosen": "x", "rejected": "wxyz"}]
    out = user_data.preference_arrays(write(tmp_path / "p.jsonl", rows), byte, max_length=8)
    assert out.n_cut == 1
    assert_row(out.arrays, 0, [byte.bos_id, *byte.encode("efwxyz"), byte.eos_id], byte.pad_id, "rejected_")
    assert_row(out.arrays, 0, [byte.bos_id, *byte.encode("efx"), byte.eos_id], byte.pad_id, "chosen_")
    with pytest.raises(DataError, match=r"p\.jsonl line 1: field 'rejected' needs 6 tokens.*at least 6"):
        user_data.preference_arrays(tmp_path / "p.jsonl", byte, max_length=5)


def test_completion_that_cannot_fit_names_the_row_and_the_length(tmp_path):
    rows = [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "bcdefgh"}]
    with pytest.raises(DataError, match=r"c\.jsonl line 2: the row needs 9 tokens .* max_length=5; raise "
                                        r"max_length to at least 9"):
        user_data.sft_arrays(write(tmp_path / "c.jsonl", rows), byte, max_length=5)


def test_grpo_max_length_bounds_the_prompt(tmp_path):
    out = user_data.prompt_arrays(write(tmp_path / "g.jsonl", [{"prompt": "abcdef"}, {"prompt": "ab"}]), byte,
                                  max_length=4)
    assert out.n_cut == 1
    assert out.arrays["prompt_tokens"].tolist() == [[byte.bos_id, *byte.encode("def")],
                                                    [byte.pad_id, byte.bos_id, *byte.encode("ab")]]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a"}], r"line 2: field 'completion' is missing or null"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}],
     r"line 2: field 'completion' is missing or null"),
    ([{"prompt": "a", "completion": 3}], r"line 1: field 'completion' is int 3; it must be a string"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "  "}],
     r"line 2: field 'completion' is empty or only whitespace"),
    ([{"prompt": [user("q")], "completion": "b"}], r"line 1: field 'completion' is str 'b'; it must be a list of"),
    ([{"messages": [user("q"), assistant("a"), user("more?")]}],
     r"line 1: field 'messages' ends with a 'user' turn; .* must end with the assistant"),
    ([{"messages": [user("q"), {"role": "assistant"}]}], r"line 1: field 'messages' message 2 must be"),
    ([{"messages": [user("q"), assistant("")]}], r"line 1: field 'messages' message 2 is an empty assistant turn"),
])
def test_row_errors_name_file_line_and_field(tmp_path, rows, message):
    with pytest.raises(DataError, match=r"bad\.jsonl " + message):
        user_data.sft_arrays(write(tmp_path / "bad.jsonl", rows), chatml)


def test_jsonl_lines_count_blank_lines_and_bad_json(tmp_path):
    path = tmp_path / "gap.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a", "completion": ""}\n')
    with pytest.raises(DataError, match=r"gap\.jsonl line 3: field 'completion' is empty"):
        user_data.sft_arrays(path, byte)
    path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": "b"\n')
    with pytest.raises(DataError, match=r"gap\.jsonl line 2: not valid JSON"):
        user_data.sft_arrays(path, byte)


def test_parquet_rows_are_named_by_number(tmp_path):
    path = write(tmp_path / "d.parquet", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}])
    with pytest.raises(DataError, match=r"d\.parquet row 2: field 'completion' is empty"):
        user_data.sft_arrays(path, byte)


def test_columns_that_fit_no_format(tmp_path):
    path = write(tmp_path / "q.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"q\.jsonl: columns \['question', 'answer'\] fit no sft format; sft accepts "
                                        r"\(messages: messages; prompt_completion: prompt, completion; "
                                        r"language_modeling: text\)"):
        user_data.sft_arrays(path, byte)
    with pytest.raises(DataError, match=r"fit no dpo format; dpo accepts \(preference: prompt, chosen, rejected"):
        user_data.preference_arrays(path, byte)
    both = write(tmp_path / "both.jsonl", [{"messages": CHAT, "prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match=r"both\.jsonl: columns .* fit several SFT formats"):
        user_data.sft_arrays(both, chatml)


def test_conversations_need_a_chat_template(tmp_path):
    with pytest.raises(DataError, match=r"m\.jsonl line 1: conversational rows need a chat template.*ByteTokenizer"):
        user_data.sft_arrays(write(tmp_path / "m.jsonl", [{"messages": CHAT}]), byte)


def test_implicit_prompt_needs_a_common_start(tmp_path):
    with pytest.raises(DataError, match=r"i\.jsonl line 1: 'chosen' and 'rejected' must start with the same prompt"):
        user_data.preference_arrays(write(tmp_path / "i.jsonl", [{"chosen": "yes", "rejected": "no"}]), byte)


def test_a_hub_dataset_id_is_read_with_its_split_and_revision(tmp_path, monkeypatch):
    """The online path without a network: `datasets.load_dataset` answers for the Hub id (as it
    would online), and the rows encode exactly as the same rows from a local file; errors name the row."""
    import datasets

    rows = [{"prompt": "add 1+2=", "completion": "3"}, {"prompt": "add 2+2=", "completion": "4"}]
    splits = {"train": write(tmp_path / "hub_train.jsonl", rows),
              "test": write(tmp_path / "hub_test.jsonl", rows[:1] + [{"prompt": "x", "completion": ""}])}
    asked = []
    load_dataset = datasets.load_dataset

    # the split's rows as a Dataset, read by `datasets` from a file (Dataset.from_list's fingerprint
    # pickles pyarrow types, which failed with the TPU test machine's pyarrow: share s3)
    def from_the_hub(path, split=None, revision=None, **kwargs):
        asked.append((path, split, revision))
        return load_dataset("json", data_files=str(splits[split]), split="train")

    local = user_data.sft_arrays(write(tmp_path / "same.jsonl", rows), byte)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets, "load_dataset", from_the_hub)
    from_hub = user_data.sft_arrays("someone/some-data", byte)
    assert all(np.array_equal(from_hub.arrays[k], local.arrays[k]) for k in SFT_KEYS)
    assert user_data.read_table("someone/some-data", split="test", revision="abc").rows[0] == rows[0]
    assert asked == [("someone/some-data", "train", None), ("someone/some-data", "test", "abc")]
    with pytest.raises(DataError, match=r"someone/some-data row 2.*completion"):
        user_data.sft_arrays(user_data.read_table("someone/some-data", split="test"), byte)


def test_sources_that_are_not_files(tmp_path, monkeypatch):
    import datasets

    with pytest.raises(DataError, match=r"missing\.jsonl: file not found"):
        user_data.sft_arrays(tmp_path / "missing.jsonl", byte)
    with pytest.raises(DataError, match=r"d\.csv: unsupported file type; pass a \.jsonl, \.json or \.parquet"):
        user_data.sft_arrays(tmp_path / "d.csv", byte)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"someone/some-data: not a local file, and the Hugging Face Hub is offline"):
        user_data.sft_arrays("someone/some-data", byte)
    with pytest.raises(DataError, match=r"max_length must be an int >= 2"):
        user_data.sft_arrays(tmp_path / "missing.jsonl", byte, max_length=0)


# ---------------------------------------------------------------- the shipped task, batches


def test_shipped_files_through_user_data_equal_the_shipped_arrays():
    out = user_data.sft_arrays(data.DATA_DIR / "sft_train.jsonl", byte, seq_len=data.DEFAULT_SEQ_LEN)
    expected = data.sft_arrays(data.load_sft(), byte, data.DEFAULT_SEQ_LEN)
    for k in SFT_KEYS:
        assert np.array_equal(out.arrays[k], expected[k]), k


def test_batches_are_a_pure_function_of_seed_and_step(tmp_path):
    rows = [{"prompt": f"p{i}=", "completion": "x" * (1 + i % 3)} for i in range(10)]
    path = write(tmp_path / "b.jsonl", rows)
    first, second = (user_data.sft_arrays(path, byte).arrays for _ in range(2))
    for step in (0, 3, 7):
        a, b = data.batch_at(first, step, 4, seed=5), data.batch_at(second, step, 4, seed=5)
        assert all(np.array_equal(a[k], b[k]) for k in SFT_KEYS)
    assert not np.array_equal(data.batch_at(first, 0, 4, seed=5)["inputs"], data.batch_at(first, 1, 4, seed=5)["inputs"])


def test_grpo_rollout_from_user_rows_equals_the_shipped_path(tmp_path):
    from tunix_nb import grpo, model, rewards

    examples = data.load_sft()[:8]
    encoded = user_data.prompt_arrays(write(tmp_path / "g.jsonl", examples), byte, prompt_len=data.DEFAULT_PROMPT_LEN)
    graphdef, params = model.split(model.make_model("tiny", seed=0))
    kwargs = dict(batch_size=4, group_size=2, seed=3, beta=0.0, max_new_tokens=4, compute_dtype=None)
    reward_set = rewards.combine([rewards.exact_match])
    shipped = grpo.make_rollout(graphdef, examples, reward_set, **kwargs)(1, params, None)
    mine = grpo.make_rollout(graphdef, encoded.examples, reward_set, rows=encoded.arrays, **kwargs)(1, params, None)
    assert sorted(mine[0]) == sorted(shipped[0]) and mine[1] == shipped[1]
    for k in shipped[0]:
        assert np.array_equal(mine[0][k], shipped[0][k]), k
    with pytest.raises(ValueError, match="got 8 encoded prompts for 7 examples"):
        grpo.make_rollout(graphdef, examples[:7], reward_set, rows=encoded.arrays, **kwargs)


@pytest.mark.parametrize("content", [b"", b"\n  \n"], ids=["empty", "blank lines"])
def test_an_empty_file_is_named_as_empty(tmp_path, content):
    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=r"train\.jsonl: the file is empty; give it the examples"):
        user_data.read_table(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_byte_that_is_not_utf8_is_named_with_its_line_and_column(tmp_path, suffix):
    path = tmp_path / f"train{suffix}"
    path.write_bytes(b'[{"prompt": "a", "completion": "b"},\n {"prompt": "caf\xe9", "completion": "x"}]\n'
                     if suffix == ".json" else b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9"}\n')
    column = 17 if suffix == ".json" else 16
    with pytest.raises(DataError, match=rf"train\{suffix} line 2: byte 0xe9 at column {column} is not UTF-8; "
                                        "save the file as UTF-8"):
        user_data.read_table(path)


def test_a_role_templates_do_not_know_is_refused_with_the_mapping(tmp_path):
    """ShareGPT's 'human' / 'gpt' would reach the template as they are, and a 'gpt' answer would get no loss."""
    path = write(tmp_path / "chat.jsonl", [{"messages": [user("hi"), assistant("hello")]},
                                          {"messages": [{"role": "human", "content": "hi"},
                                                        {"role": "gpt", "content": "hello"}]}])
    with pytest.raises(DataError, match=r"chat\.jsonl line 2: field 'messages' message 1 has role 'human'; roles are "
                                        r"'system', 'user', 'assistant', 'tool'\. Map the others .*'gpt' is 'assistant'"):
        user_data.sft_arrays(path, chatml)
