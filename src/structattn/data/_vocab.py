"""The token <-> id map shared by the data sets' vocabularies."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

V = TypeVar("V", bound="TokenVocabulary")


@dataclass(frozen=True)
class TokenVocabulary:
    """Tokens with their special tokens first (``<pad>`` = 0, ``<unk>`` = 1, then the
    subclass's others); unknown tokens encode to ``<unk>``. Subclasses set ``SPECIALS``,
    ``KIND`` (the name in :meth:`to_dict`) and a ``build`` rule."""

    tokens: tuple[str, ...]  # tokens[i] is the token with id i
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    PAD: ClassVar[str] = "<pad>"
    UNK: ClassVar[str] = "<unk>"
    SPECIALS: ClassVar[tuple[str, ...]] = (PAD, UNK)
    KIND: ClassVar[str] = "structattn.TokenVocabulary"

    def __post_init__(self) -> None:
        tokens = tuple(self.tokens)
        specials = self.SPECIALS
        if tokens[: len(specials)] != specials:
            raise ValueError(
                f"a vocabulary must start with {specials}, got {tokens[: len(specials)]}"
            )
        if not all(isinstance(t, str) and t for t in tokens):
            raise ValueError("vocabulary tokens must be non-empty strings")
        if len(set(tokens)) != len(tokens):
            dup = sorted(t for t, c in Counter(tokens).items() if c > 1)
            raise ValueError(f"duplicate vocabulary tokens: {dup}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "_index", {t: i for i, t in enumerate(tokens)})

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, token: object) -> bool:
        return token in self._index

    @property
    def pad_id(self) -> int:
        """Id of ``<pad>`` (0)."""
        return 0

    @property
    def unk_id(self) -> int:
        """Id of ``<unk>`` (1)."""
        return 1

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """Ids of the tokens; unknown tokens map to :attr:`unk_id`."""
        return [self._index.get(t, self.unk_id) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Tokens of the ids (specials included); ``ValueError`` on an id out of range."""
        out = []
        for i in ids:
            j = operator.index(i)
            if not 0 <= j < len(self.tokens):
                raise ValueError(f"id {j} out of range for a vocabulary of {len(self.tokens)}")
            out.append(self.tokens[j])
        return out

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready description (plain strings and lists) for checkpoints."""
        return {"kind": self.KIND, "version": 1, "tokens": list(self.tokens)}

    @classmethod
    def from_dict(cls: type[V], state: Mapping[str, object]) -> V:
        """Inverse of :meth:`to_dict`."""
        if state.get("kind") != cls.KIND or state.get("version") != 1:
            raise ValueError(f"not a version-1 {cls.KIND} dict")
        tokens = state.get("tokens")
        if not isinstance(tokens, list):
            raise ValueError("vocabulary dict needs a list of 'tokens'")
        return cls(tuple(tokens))
