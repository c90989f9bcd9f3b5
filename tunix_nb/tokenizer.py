"""Tokenizers: the `Tokenizer` protocol the kit codes against, and a byte tokenizer.

A byte tokenizer needs no training and no download, handles any UTF-8 text, and keeps
the vocabulary tiny (259), so the lessons' models stay small enough for a CPU.
Anything with the same few members (e.g. a wrapper around a SentencePiece model)
can stand in for it.
"""

from __future__ import annotations

import operator
from typing import Iterable, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the generation loop need from a tokenizer.

    `encode` returns only the text's ids, with no bos/eos: callers add those, so a
    prompt and its completion can be encoded separately and joined.
    """

    pad_id: int
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: pad=0, bos=1, eos=2, byte b -> id b+3 (vocab_size=259).

    >>> tok = ByteTokenizer()
    >>> tok.encode("hi")
    [107, 108]
    >>> tok.decode([1, 107, 108, 2, 0])
    'hi'
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2
    n_special = 3  # ids below this are special; byte b is id b + n_special
    vocab_size = 256 + n_special

    def encode(self, text: str) -> list[int]:
        """The ids of `text`'s UTF-8 bytes (no bos/eos)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}; decode bytes to str first.")
        return [b + self.n_special for b in text.encode("utf-8")]

    def _checked(self, ids: Iterable[int]) -> list[int]:
        """ids as plain ints, each checked to be in [0, vocab_size)."""
        out = []
        for i in ids:
            i = operator.index(i)  # accepts Python and NumPy ints, rejects floats
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is out of range: valid ids are 0..{self.vocab_size - 1} "
                    f"(vocab_size={self.vocab_size}). Check that the model's vocab_size "
                    "matches the tokenizer's."
                )
            out.append(i)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, skipping pad/bos/eos wherever they are.

        It does not stop at eos (cut there first if you need to). Invalid UTF-8,
        which a model can generate, becomes U+FFFD instead of raising.
        """
        data = bytes(i - self.n_special for i in self._checked(ids) if i >= self.n_special)
        return data.decode("utf-8", errors="replace")

    def render(self, ids: Iterable[int]) -> str:
        """Like decode, but shows special tokens as <pad>/<bos>/<eos>, to inspect a row."""
        names = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
        parts, run = [], []
        for i in self._checked(ids) + [self.pad_id]:  # sentinel flushes the last run
            if i in names:
                if run:
                    parts.append(bytes(run).decode("utf-8", errors="replace"))
                    run = []
                parts.append(names[i])
            else:
                run.append(i - self.n_special)
        return "".join(parts[:-1])

    def __repr__(self) -> str:
        return (
            f"ByteTokenizer(vocab_size={self.vocab_size}, pad_id={self.pad_id}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, byte b -> id b+{self.n_special})"
        )
