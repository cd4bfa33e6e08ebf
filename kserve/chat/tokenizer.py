"""Kimi K2 tiktoken tokenizer, read from a model directory's files alone.

Mirrors the published ``tokenization_kimi.py`` behaviour (pre-tokenization regex, special-token numbering, the
400,000 / 25,000-character chunking rule) without transformers or trust_remote_code.
"""

from __future__ import annotations

import base64
import codecs
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import tiktoken

# K2's pre-tokenization pattern (o200k-style plus a Han alternative and `&&` class intersections; tiktoken's
# fancy-regex understands the intersections).
K2_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_RESERVED_SPECIAL_TOKENS = 256
K2_BASE_VOCAB_SIZE = 163584
MAX_ENCODE_CHARS = 400_000  # guard against a pyo3 panic on huge inputs (tokenization_kimi.py)
MAX_NO_WHITESPACE_CHARS = 25_000  # openai/tiktoken#195: cut long same-class runs

BOS_TOKEN = "[BOS]"
EOS_TOKEN = "[EOS]"
IM_END_TOKEN = "<|im_end|>"


def _read_bpe_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def _split_long_runs(text: str, max_run: int) -> list[str]:
    """Cut runs of all-whitespace or all-non-whitespace characters longer than ``max_run`` (HF tokenization_kimi)."""
    pieces: list[str] = []
    start = 0
    run_len = 0
    current_is_space = False
    for i, ch in enumerate(text):
        is_space = ch.isspace()
        if i > start and is_space == current_is_space:
            run_len += 1
            if run_len > max_run:
                pieces.append(text[start:i])
                start = i
                run_len = 1
        else:
            current_is_space = is_space
            run_len = 1
    pieces.append(text[start:])
    return pieces


def _iter_chunks(text: str):
    for i in range(0, len(text), MAX_ENCODE_CHARS):
        yield from _split_long_runs(text[i : i + MAX_ENCODE_CHARS], MAX_NO_WHITESPACE_CHARS)


@dataclass
class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; never emits a partial UTF-8 character.

    Uses an incremental UTF-8 decoder with ``errors="replace"``, so the concatenated output equals
    ``tokenizer.decode(all_ids)``.
    """

    tokenizer: "KimiTokenizer"
    skip_special_tokens: bool = False
    _decoder: codecs.IncrementalDecoder = field(init=False)

    def __post_init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_ids) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        data = b"".join(
            self.tokenizer.token_bytes(t)
            for t in token_ids
            if not (self.skip_special_tokens and self.tokenizer.is_skippable(t))
        )
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class KimiTokenizer:
    """K2 tokenizer: BPE ranks from ``tiktoken.model``, special tokens from ``tokenizer_config.json``."""

    def __init__(self, mergeable_ranks: dict[bytes, int], added_tokens: dict[int, tuple[str, bool]], name: str = "kimi"):
        self.base_vocab_size = len(mergeable_ranks)
        base = self.base_vocab_size
        specials: dict[str, int] = {}
        for token_id in range(base, base + NUM_RESERVED_SPECIAL_TOKENS):
            content = added_tokens.get(token_id, (f"<|reserved_token_{token_id}|>", True))[0]
            specials[content] = token_id
        for token_id, (content, _) in added_tokens.items():
            specials.setdefault(content, token_id)
        self.special_ids: dict[str, int] = specials
        self._special_by_id: dict[int, str] = {i: s for s, i in specials.items()}
        # Ids with the `special: true` flag (or reserved); tool markers are `special: false` and survive skipping.
        self._skippable: frozenset[int] = frozenset(
            i for i in self._special_by_id if added_tokens.get(i, ("", True))[1]
        )
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=K2_PAT_STR, mergeable_ranks=mergeable_ranks, special_tokens=specials
        )
        self._bytes_by_id: list[bytes] = [b""] * base
        for token, rank in mergeable_ranks.items():
            self._bytes_by_id[rank] = token
        self.vocab_size = max(base + NUM_RESERVED_SPECIAL_TOKENS, max(self._special_by_id) + 1)
        self.bos_id = specials[BOS_TOKEN]
        self.eos_id = specials[EOS_TOKEN]
        self.im_end_id = specials[IM_END_TOKEN]
        self.stop_token_ids: list[int] = [self.eos_id, self.im_end_id]
        self.special_token_regex: re.Pattern = re.compile(
            "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
        )

    # -- encoding -------------------------------------------------------------------------------------------
    def encode(self, text: str, allow_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        for chunk in _iter_chunks(text):
            if allow_special_tokens:
                ids.extend(self._encoding.encode(chunk, allowed_special="all"))
            else:
                ids.extend(self._encoding.encode(chunk, disallowed_special=()))
        return ids

    # -- decoding -------------------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < self.base_vocab_size:
            return self._bytes_by_id[token_id]
        special = self._special_by_id.get(token_id)
        if special is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return special.encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_by_id

    def is_skippable(self, token_id: int) -> bool:
        """True for ids that ``skip_special_tokens=True`` drops (not the tool-call markers)."""
        return token_id in self._skippable

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        data = b"".join(
            self.token_bytes(t) for t in ids if not (skip_special_tokens and t in self._skippable)
        )
        return data.decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def id_of(self, token: str) -> int:
        return self.special_ids[token]


def _read_added_tokens(config_path: Path, base_vocab_size: int) -> dict[int, tuple[str, bool]]:
    if not config_path.exists():
        return {}
    config = json.loads(config_path.read_text(encoding="utf-8"))
    decoder = config.get("added_tokens_decoder") or {}
    added = {int(k): (v["content"], bool(v.get("special", True))) for k, v in decoder.items()}
    if added and min(added) >= base_vocab_size + NUM_RESERVED_SPECIAL_TOKENS and min(added) >= K2_BASE_VOCAB_SIZE:
        # A small vocabulary whose config still lists K2's absolute ids: keep K2's offsets from 163584.
        added = {base_vocab_size + (i - K2_BASE_VOCAB_SIZE): v for i, v in added.items()}
    return added


def load_tokenizer(model_dir: str | Path) -> KimiTokenizer:
    """Load the K2 tokenizer from ``model_dir/tiktoken.model`` and ``model_dir/tokenizer_config.json``."""
    model_dir = Path(model_dir)
    model_file = model_dir / "tiktoken.model"
    if not model_file.exists():
        raise FileNotFoundError(f"no tiktoken.model in {model_dir}")
    ranks = _read_bpe_ranks(model_file)
    added = _read_added_tokens(model_dir / "tokenizer_config.json", len(ranks))
    return KimiTokenizer(ranks, added, name=str(model_file))
