import hashlib
import json
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

from tunix_nb import data
from tunix_nb.data import DataError
from tunix_nb.tokenizer import ByteTokenizer

tok = ByteTokenizer()
KEYS = ("inputs", "targets", "loss_mask", "attention_mask")
FILES = ["sft_train.jsonl", "sft_eval.jsonl", "preferences_train.jsonl", "preferences_eval.jsonl"]


def read(name):
    return [json.loads(line) for line in (data.DATA_DIR / name).read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------- an independent checker


def solve(prompt):
    """The correct answer, parsed from the prompt without using tunix_nb.data."""
    if m := re.fullmatch(r"add (\d{1,2})\+(\d{1,2})=", prompt):
        return "add", str(int(m[1]) + int(m[2])), (int(m[1]), int(m[2]))
    if m := re.fullmatch(r"rev ([a-z]{3,5})=", prompt):
        return "reverse", m[1][::-1], m[1]
    if m := re.fullmatch(r"sort (\d{3,5})=", prompt):
        return "sort", "".join(sorted(m[1])), m[1]
    if m := re.fullmatch(r"swap ([a-z])>([a-z]) ([a-z]{3,5})=", prompt):
        x, y, w = m[1], m[2], m[3]
        assert x != y and x in w
        return "swap", "".join(y if c == x else c for c in w), (x, y, w)
    raise AssertionError(f"prompt matches no template: {prompt!r}")


def one_adjacent_swap(a, b):
    diff = [i for i in range(len(a)) if a[i] != b[i]]
    if len(a) != len(b) or len(diff) != 2 or diff[1] != diff[0] + 1:
        return False
    i, j = diff
    return a[i] == b[j] and a[j] == b[i]


def assert_plausible(prompt, chosen, rejected):
    task, answer, args = solve(prompt)
    assert chosen == answer and rejected and rejected != chosen
    if task == "add":
        a, b = args
        no_carry = int("".join(str((int(x) + int(y)) % 10) for x, y in zip(f"{a:03d}", f"{b:03d}")))
        assert rejected.isdigit() and str(int(rejected)) == rejected  # a number, no leading zeros
        assert int(rejected) in {a + b - 1, a + b + 1, no_carry}
    elif task == "reverse":
        w = args
        assert sorted(rejected) == sorted(w)  # same letters
        assert rejected == w or rejected == w[0] + w[1:-1][::-1] + w[-1] or one_adjacent_swap(answer, rejected)
    elif task == "sort":
        assert rejected.isdigit() and len(rejected) == len(answer)
        diff = [i for i in range(len(answer)) if answer[i] != rejected[i]]
        off_by_one = len(diff) == 1 and abs(int(answer[diff[0]]) - int(rejected[diff[0]])) == 1
        assert off_by_one or one_adjacent_swap(answer, rejected)
    else:
        x, y, w = args
        diff = [i for i in range(len(w)) if answer[i] != rejected[i]]
        assert len(rejected) == len(w) and len(diff) == 1 and w[diff[0]] == x and rejected[diff[0]] == x


# ---------------------------------------------------------------- the shipped files


def test_regenerating_matches_shipped_files(tmp_path):
    data.write_datasets(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (data.DATA_DIR / name).read_bytes(), name


def test_cli_regenerates(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tunix_nb.data", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "sft_train.jsonl" in out and "4000 lines" in out
    assert (tmp_path / "sft_train.jsonl").read_bytes() == (data.DATA_DIR / "sft_train.jsonl").read_bytes()


def test_sizes_and_line_counts():
    assert sum((data.DATA_DIR / n).stat().st_size for n in FILES) <= 2_000_000
    expected = [data.N_SFT_TRAIN, data.N_SFT_EVAL, data.N_PREF_TRAIN, data.N_PREF_EVAL]
    assert [len(read(n)) for n in FILES] == expected


def test_tasks_balanced():
    for name in FILES:
        counts = {t: 0 for t in data.TASKS}
        for row in read(name):
            counts[row["task"]] += 1
        assert max(counts.values()) - min(counts.values()) <= 1, (name, counts)


def test_eval_prompts_disjoint_from_train():
    train = {r["prompt"] for n in ("sft_train.jsonl", "preferences_train.jsonl") for r in read(n)}
    for name in ("sft_eval.jsonl", "preferences_eval.jsonl"):
        prompts = [r["prompt"] for r in read(name)]
        assert not train & set(prompts)
        assert len(set(prompts)) == len(prompts)


def test_every_completion_is_correct():
    for name in ("sft_train.jsonl", "sft_eval.jsonl"):
        for row in read(name):
            task, answer, _ = solve(row["prompt"])
            assert (row["task"], row["completion"]) == (task, answer), row


def test_every_rejected_is_a_plausible_wrong_answer():
    for name in ("preferences_train.jsonl", "preferences_eval.jsonl"):
        for row in read(name):
            assert solve(row["prompt"])[0] == row["task"]
            assert_plausible(row["prompt"], row["chosen"], row["rejected"])


def test_loaders_accept_shipped_files():
    assert len(data.load_sft()) == data.N_SFT_TRAIN
    assert len(data.load_preferences()) == data.N_PREF_TRAIN
    assert len(data.load_sft(data.DATA_DIR / "sft_eval.jsonl")) == data.N_SFT_EVAL


def test_default_lengths_fit_every_example():
    rows = [r for n in FILES for r in read(n)]
    answers = [r[k] for r in rows for k in ("completion", "chosen", "rejected") if k in r]
    max_prompt = max(len(tok.encode(r["prompt"])) for r in rows)
    max_answer = max(len(tok.encode(a)) for a in answers)
    assert max_prompt + 1 <= data.DEFAULT_PROMPT_LEN
    assert max_answer + 1 <= data.MAX_NEW_TOKENS
    assert 1 + max_prompt + max_answer + 1 <= data.DEFAULT_SEQ_LEN + 1  # a row is seq_len + 1 tokens
    data.sft_arrays(data.load_sft(), tok, data.DEFAULT_SEQ_LEN)  # and encoding raises nothing


def test_generators_are_seeded_and_exclude():
    a, b = data.generate_preferences(50, seed=3), data.generate_preferences(50, seed=3)
    assert a == b and a != data.generate_preferences(50, seed=4)
    first = data.generate_sft(100, seed=1)
    more = data.generate_sft(100, seed=1, exclude={r["prompt"] for r in first})
    assert not {r["prompt"] for r in first} & {r["prompt"] for r in more}


def test_generator_runs_out_of_prompts():
    with pytest.raises(ValueError, match="ran out of new 'add' prompts"):
        data.generate_sft(4 * 10_001, seed=0)


# ---------------------------------------------------------------- load_jsonl errors


def write(tmp_path, text, name="x.jsonl"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


GOOD = '{"prompt": "add 1+2=", "completion": "3"}\n'


@pytest.mark.parametrize(
    "text, message",
    [
        (GOOD + '{"prompt": "add 1+2=", "completion": \n', r"line 2: malformed JSON"),
        (GOOD + '["add 1+2=", "3"]\n', r"line 2: expected a JSON object \{\.\.\.\}, got list"),
        (
            GOOD + GOOD + '{"prompt": "add 1+2="}\n',
            r"line 3: missing key 'completion' \(each line needs 'prompt' and 'completion'",
        ),
        ('{"prompt": "add 1+2=", "completion": "  "}\n', r"line 1: 'completion' is empty or only whitespace"),
        ('{"prompt": "add 1+2=", "completion": ""}\n', r"line 1: 'completion' is empty"),
        ('{"prompt": "add 1+2=", "completion": 3}\n', r"line 1: 'completion' must be a string, got int 3"),
        (GOOD + "\n" + GOOD, r"line 2: blank line between records"),
        ("", r"the file is empty"),
        ("\n\n", r"the file is empty"),
    ],
)
def test_load_jsonl_errors(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(DataError, match=message) as err:
        data.load_jsonl(path, ["prompt", "completion"])
    assert str(err.value).startswith(str(path))
    assert "python -m tunix_nb.data" in str(err.value)  # every message says how to fix it


def test_error_names_file_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    write(tmp_path / "data", GOOD + '{"prompt": "p"}\n', "sft_train.jsonl")
    with pytest.raises(DataError, match=r"^data/sft_train\.jsonl line 2: missing key 'completion'"):
        data.load_sft("data/sft_train.jsonl")


def test_load_jsonl_trailing_newline_and_extra_keys(tmp_path):
    path = write(tmp_path, GOOD + '{"prompt": "é", "completion": "b", "task": "t"}')  # no final newline
    rows = data.load_jsonl(path, ["prompt", "completion"])
    assert rows[1] == {"prompt": "é", "completion": "b", "task": "t"}
    assert len(data.load_jsonl(write(tmp_path, GOOD + GOOD + "\n"), ["prompt", "completion"])) == 2


def test_load_jsonl_missing_file_and_bad_utf8(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        data.load_jsonl(tmp_path / "nope.jsonl", ["prompt"])
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD.encode() + b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match="line 2: not valid UTF-8"):
        data.load_jsonl(path, ["prompt"])


def test_load_preferences_needs_rejected(tmp_path):
    path = write(tmp_path, '{"prompt": "p", "chosen": "a"}\n')
    needs = r"each line needs 'prompt' and 'chosen' and 'rejected'"
    with pytest.raises(DataError, match=rf"line 1: missing key 'rejected' \({needs}"):
        data.load_preferences(path)


# ---------------------------------------------------------------- rows and masks


def test_encode_sft_row_layout():
    prompt, completion, L = "add 1+2=", "3", 16
    a = data.encode_sft(tok, prompt, completion, L)
    row = [tok.bos_id, *tok.encode(prompt), *tok.encode(completion), tok.eos_id]
    row += [tok.pad_id] * (L + 1 - len(row))
    assert a["inputs"].tolist() == row[:-1] and a["targets"].tolist() == row[1:]
    assert a["inputs"].dtype == a["targets"].dtype == a["attention_mask"].dtype == np.int32
    assert a["loss_mask"].dtype == np.float32
    # Loss exactly on the completion's bytes and the eos.
    masked = [t for t, m in zip(a["targets"].tolist(), a["loss_mask"]) if m]
    assert masked == [*tok.encode(completion), tok.eos_id]
    assert a["attention_mask"].tolist() == [int(i != tok.pad_id) for i in a["inputs"]]


def test_encode_sft_exact_fit():
    prompt, completion = "rev abc=", "cba"
    L = 1 + len(prompt) + len(completion) + 1 - 1
    a = data.encode_sft(tok, prompt, completion, L)
    assert a["targets"][-1] == tok.eos_id and a["attention_mask"].all()


def test_sft_arrays_masks_on_shipped_data():
    examples = data.load_sft(data.DATA_DIR / "sft_eval.jsonl")
    a = data.sft_arrays(examples, tok, data.DEFAULT_SEQ_LEN)
    n, L = len(examples), data.DEFAULT_SEQ_LEN
    assert {k: v.shape for k, v in a.items()} == {k: (n, L) for k in KEYS}
    assert (a["inputs"][:, 1:] == a["targets"][:, :-1]).all()  # shifted by one
    assert (a["attention_mask"] == (a["inputs"] != tok.pad_id)).all()
    for i, ex in enumerate(examples):
        masked = a["targets"][i][a["loss_mask"][i] == 1].tolist()
        assert masked == [*tok.encode(ex["completion"]), tok.eos_id]


def test_too_long_raises_with_fix():
    message = (
        r"needs 15 tokens \(bos \+ 9 prompt \+ 4 completion \+ eos\), i\.e\. seq_len >= 14, "
        r"but seq_len=10\. Raise seq_len to 14, or pass truncate=True"
    )
    with pytest.raises(DataError, match=message):
        data.encode_sft(tok, "rev abcd=", "dcba", 10)


def test_truncate_warns_and_keeps_prompt():
    with pytest.warns(UserWarning, match=r"truncated 3 token\(s\)"):
        a = data.encode_sft(tok, "rev abcd=", "dcba", 11, truncate=True)
    masked = a["targets"][a["loss_mask"] == 1].tolist()
    assert masked == tok.encode("dc")  # the completion's end and eos were cut
    assert a["attention_mask"].all()


def test_prompt_too_long_always_raises():
    for truncate in (False, True):
        message = r"prompt 'rev abcd=' is 9 tokens.*needs seq_len >= 10, got seq_len=9"
        with pytest.raises(DataError, match=message):
            data.encode_sft(tok, "rev abcd=", "dcba", 9, truncate=truncate)


def test_sft_arrays_one_truncation_warning():
    examples = [{"prompt": "rev abcd=", "completion": "dcba"}] * 3 + [{"prompt": "add 1+2=", "completion": "3"}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data.sft_arrays(examples, tok, 11, truncate=True)
    assert len(caught) == 1 and "3 of 4 examples" in str(caught[0].message)
    with pytest.raises(DataError, match="pass truncate=True"):
        data.sft_arrays(examples, tok, 11)


def test_bad_seq_len_and_no_examples():
    with pytest.raises(DataError, match="seq_len must be a positive int"):
        data.encode_sft(tok, "a", "b", 0)
    with pytest.raises(DataError, match="no SFT examples"):
        data.sft_arrays([], tok, 8)


def test_preference_arrays():
    examples = data.load_preferences(data.DATA_DIR / "preferences_eval.jsonl")[:20]
    a = data.preference_arrays(examples, tok, data.DEFAULT_SEQ_LEN)
    assert sorted(a) == sorted(f"{side}_{k}" for side in ("chosen", "rejected") for k in KEYS)
    for i, ex in enumerate(examples):
        for side in ("chosen", "rejected"):
            masked = a[f"{side}_targets"][i][a[f"{side}_loss_mask"][i] == 1].tolist()
            assert masked == [*tok.encode(ex[side]), tok.eos_id]
    p = len(tok.encode(examples[0]["prompt"])) + 1
    assert a["chosen_inputs"][0, :p].tolist() == a["rejected_inputs"][0, :p].tolist()  # same prompt


def test_prompt_arrays_left_padded():
    a = data.prompt_arrays(["add 1+2=", "rev ab="], tok, 10)
    assert a["tokens"].dtype == a["attention_mask"].dtype == np.int32 and a["tokens"].shape == (2, 10)
    assert a["tokens"][0].tolist() == [0, tok.bos_id, *tok.encode("add 1+2=")]
    assert a["tokens"][1].tolist() == [0, 0, tok.bos_id, *tok.encode("rev ab=")]
    assert a["attention_mask"][1].tolist() == [0, 0] + [1] * 8


def test_prompt_arrays_too_long():
    message = r"prompt 1 \('add 10\+20='\) needs 11 tokens with bos, but prompt_len=10"
    with pytest.raises(DataError, match=message):
        data.prompt_arrays(["add 1+2=", "add 10+20="], tok, 10)


def test_exact_match():
    assert data.exact_match(["42", "abc", "1 "], ["42", "abd", "1"]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="got 1 predictions but 2 references"):
        data.exact_match(["a"], ["a", "b"])


# ---------------------------------------------------------------- batches


def toy_arrays(n=10):
    x = np.arange(n, dtype=np.int32)
    return {"x": x, "y": np.repeat(x[:, None], 3, axis=1)}  # y's rows repeat x: alignment is checkable


def test_batch_at_is_pure_function_of_seed_and_step():
    arrays = toy_arrays()
    later = data.batch_at(arrays, 7, 4, seed=0)
    for step in range(7):
        data.batch_at(arrays, step, 4, seed=0)
    again = data.batch_at(arrays, 7, 4, seed=0)
    assert all((later[k] == again[k]).all() for k in arrays)
    assert (later["y"][:, 0] == later["x"]).all()  # rows stay aligned across keys
    assert not (data.batch_at(arrays, 7, 4, seed=1)["x"] == later["x"]).all()


def test_batch_at_covers_each_epoch_once():
    arrays = toy_arrays(12)
    for bs in (3, 4, 12):  # batch sizes that divide N: each epoch is whole batches
        for epoch in range(3):
            steps = range(epoch * 12 // bs, (epoch + 1) * 12 // bs)
            seen = np.concatenate([data.batch_at(arrays, s, bs, seed=5)["x"] for s in steps])
            assert sorted(seen.tolist()) == list(range(12))


def test_batch_at_epoch_is_whole_batches_and_the_remainder_sits_out():
    arrays = toy_arrays(10)  # batch 4: two batches an epoch, 2 rows left out of each
    for epoch in range(3):
        perm = np.random.default_rng([2, epoch]).permutation(10)
        seen = np.concatenate([data.batch_at(arrays, s, 4, seed=2)["x"] for s in (2 * epoch, 2 * epoch + 1)])
        assert seen.tolist() == perm[:8].tolist()
    assert all(len(data.batch_at(arrays, s, 4, seed=2)["x"]) == 4 for s in range(7))


@pytest.mark.parametrize("n, batch_size", [(10, 4), (10, 3), (7, 6), (4000, 64), (2000, 32)])
def test_batch_at_never_repeats_an_example_within_a_batch(n, batch_size):
    """Also at epoch boundaries: a batch that took the tail of one epoch's permutation and the
    head of the next could hold an example twice."""
    arrays = toy_arrays(n)
    steps = 3 * n // batch_size + 2  # across three epoch boundaries
    for seed in range(3):
        for step in range(steps):
            x = data.batch_at(arrays, step, batch_size, seed=seed)["x"]
            assert len(x) == batch_size and len(set(x.tolist())) == batch_size, (seed, step)


def test_batch_at_rows_is_that_part_of_the_batch():
    arrays = toy_arrays(10)
    for step in range(6):
        whole = data.batch_at(arrays, step, 4, seed=1)
        part = data.batch_at(arrays, step, 4, seed=1, rows=slice(2, 4))
        assert all((part[k] == whole[k][2:4]).all() for k in arrays)


@pytest.mark.parametrize(
    "step, batch_size, message",
    [
        (0, 11, r"batch_size=11 is larger than the 10 examples"),
        (0, 0, r"batch_size must be a positive int"),
        (-1, 2, r"step must be an int >= 0, got -1"),
    ],
)
def test_batch_at_errors(step, batch_size, message):
    with pytest.raises(DataError, match=message):
        data.batch_at(toy_arrays(), step, batch_size, seed=0)


def test_batch_at_mismatched_rows():
    with pytest.raises(DataError, match="different numbers of rows"):
        data.batch_at({"a": np.zeros(3), "b": np.zeros(4)}, 0, 2, seed=0)


def test_preference_arrays_too_long_offers_no_truncation():
    pair = [{"prompt": "rev abcd=", "chosen": "dcba", "rejected": "abcd"}]
    with pytest.raises(DataError, match=r"Raise seq_len to 14\.$"):
        data.preference_arrays(pair, tok, 10)


def test_uneven_batch_gives_each_device_its_own_slice_by_length():
    examples = sorted(data.load_sft()[:64], key=lambda e: len(e["completion"]))
    rows = data.sft_arrays(examples, ByteTokenizer(), data.DEFAULT_SEQ_LEN)
    batch = data.uneven_batch(rows, 0, n_devices=4, per_device=2)
    assert batch["inputs"].shape == (8, data.DEFAULT_SEQ_LEN)
    np.testing.assert_array_equal(batch["inputs"], rows["inputs"][[0, 1, 16, 17, 32, 33, 48, 49]])
    tokens = batch["loss_mask"].reshape(4, -1).sum(axis=1)
    assert tokens[0] < tokens[-1]  # the shortest answers on device 0, the longest on the last
    later = data.uneven_batch(rows, 9, n_devices=4, per_device=2)  # wraps within each slice
    np.testing.assert_array_equal(later["inputs"][:2], rows["inputs"][[2, 3]])
    with pytest.raises(data.DataError, match="at least 128 rows"):
        data.uneven_batch(rows, 0, n_devices=8, per_device=16)


def test_the_long_family_fits_its_lengths_and_is_balanced():
    from collections import Counter

    from tunix_nb.tokenizer import ByteTokenizer

    examples = data.generate_sft(2000, seed=0, family="long")
    assert Counter(e["task"] for e in examples) == {t: 1000 for t in data.LONG_TASKS}
    assert len({e["prompt"] for e in examples}) == len(examples)
    assert {len(e["completion"]) for e in examples} == set(range(data.LONG_MIN, data.LONG_MAX + 1))
    for e in examples:
        body = e["prompt"].split(" ", 1)[1][:-1]
        assert e["completion"] == (body[::-1] if e["task"] == "long_reverse" else "".join(sorted(body)))
    tok = ByteTokenizer()
    data.sft_arrays(examples, tok, data.LONG_SEQ_LEN)  # raises if a row does not fit
    data.prompt_arrays([e["prompt"] for e in examples], tok, data.LONG_PROMPT_LEN)
    longest = max(len(e["completion"]) for e in examples)
    assert longest + 1 <= data.LONG_MAX_NEW_TOKENS  # the answer and its eos
    assert data.LONG_PROMPT_LEN + data.LONG_MAX_NEW_TOKENS == data.LONG_SEQ_LEN
    with pytest.raises(ValueError, match="family must be one of"):
        data.generate_sft(4, seed=0, family="medium")


def test_the_count_familys_answers_are_running_counts_that_fit_the_long_lengths():
    from tunix_nb.tokenizer import ByteTokenizer

    assert data.running_counts("1011") == "1123" and data.running_counts("1" * 12) == "123456789012"  # mod 10
    examples = data.generate_sft(600, seed=0, family="count")
    assert {e["task"] for e in examples} == set(data.COUNT_TASKS) and len({e["prompt"] for e in examples}) == 600
    for e in examples:
        bits = e["prompt"].removeprefix("cnt ").removesuffix("=")
        assert set(bits) <= {"0", "1"} and data.LONG_MIN <= len(bits) <= data.LONG_MAX
        # digit i: the 1s among the first i bits, counted independently of the generator
        assert e["completion"] == "".join(str(bits[:i + 1].count("1") % 10) for i in range(len(bits)))
    tok = ByteTokenizer()
    data.sft_arrays(examples, tok, data.LONG_SEQ_LEN)  # raises if a row does not fit
    data.prompt_arrays([e["prompt"] for e in examples], tok, data.LONG_PROMPT_LEN)


def test_the_count14_familys_answers_are_running_counts_of_exactly_14_bits():
    """The count14 family: the count family's answers, every one of LONG_MAX = 14 bits; the
    count family's draws stay what they were (its default length range is untouched)."""
    examples = data.generate_sft(300, seed=0, family="count14")
    assert {e["task"] for e in examples} == set(data.COUNT_TASKS) and len({e["prompt"] for e in examples}) == 300
    for e in examples:
        bits = e["prompt"].removeprefix("cnt ").removesuffix("=")
        assert len(bits) == 14 and set(bits) <= {"0", "1"}
        assert e["completion"] == "".join(str(bits[:i + 1].count("1") % 10) for i in range(14))
    counts = data.generate_sft(300, seed=0, family="count")
    assert min(len(e["completion"]) for e in counts) < 14
    # the count family's draws before count14 was added (sha256 of their JSON, the code of that commit)
    digest = hashlib.sha256(json.dumps(counts).encode()).hexdigest()
    assert digest.startswith("2544fccb46fccc9e"), digest
