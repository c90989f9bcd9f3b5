import random

import numpy as np
import pytest

from tunix_nb.tokenizer import ByteTokenizer, Tokenizer

tok = ByteTokenizer()


def test_ids_and_vocab():
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 259)
    assert tok.encode("A") == [ord("A") + 3]
    assert tok.encode("") == []
    assert tok.encode("\x00") == [3]  # byte 0 is the lowest byte id
    assert tok.encode("ÿ") == [0xC3 + 3, 0xBF + 3]  # one character, two UTF-8 bytes


def test_encode_adds_no_special_tokens():
    ids = tok.encode("add 1+2=")
    assert all(i >= 3 for i in ids) and len(ids) == len("add 1+2=")


TEXTS = ["hello", "café déjà vu", "日本語のテキスト", "🙂👍🏽", "", "a\nb\r\n\tc", " "]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_random_code_points():
    rng = random.Random(0)
    for _ in range(500):
        chars = []
        for _ in range(rng.randint(0, 20)):
            cp = rng.randint(0, 0x10FFFF)
            while 0xD800 <= cp <= 0xDFFF:  # surrogates are not encodable as UTF-8
                cp = rng.randint(0, 0x10FFFF)
            chars.append(chr(cp))
        text = "".join(chars)
        assert tok.decode(tok.encode(text)) == text


def test_decode_skips_special_ids_everywhere():
    ids = [tok.bos_id, *tok.encode("ab"), tok.eos_id, *tok.encode("c"), tok.pad_id, tok.pad_id]
    assert tok.decode(ids) == "abc"  # does not stop at eos: callers cut there


def test_decode_accepts_numpy_ids():
    arr = np.array([1, *tok.encode("hi"), 2, 0], dtype=np.int32)
    assert tok.decode(arr) == "hi"


def test_decode_invalid_utf8_is_replaced():
    ids = [0xE6 + 3, 0x97 + 3]  # a truncated 3-byte sequence, as a model might emit
    assert tok.decode(ids) == "\ufffd"


@pytest.mark.parametrize("bad", [-1, 259, 1000])
def test_decode_out_of_range_id(bad):
    with pytest.raises(ValueError, match=rf"token id {bad} is out of range: valid ids are 0\.\.258"):
        tok.decode([5, bad])


def test_encode_rejects_non_str():
    with pytest.raises(TypeError, match="needs a str"):
        tok.encode(b"bytes")


def test_render_shows_special_tokens():
    ids = [1, *tok.encode("é!"), 2, 0]
    assert tok.render(ids) == "<bos>é!<eos><pad>"


def test_protocol_and_repr():
    assert isinstance(tok, Tokenizer)
    assert "vocab_size=259" in repr(tok) and "eos_id=2" in repr(tok)
