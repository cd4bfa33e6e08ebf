"""K2 tokenizer: exact ids against the published vectors, round trips, chunking and the incremental detokenizer."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chat_support import K2_DIR, real_tokenizer, require_shared

from kserve.chat import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return real_tokenizer()


def test_vectors_match_exactly_in_both_modes(tok):
    rows = [json.loads(line) for line in (require_shared() / "tokenizer_vectors.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) >= 50
    for row in rows:
        assert tok.encode(row["text"]) == row["ids"], row["text"]
        assert tok.encode(row["text"], allow_special_tokens=False) == row["ids_special_as_text"], row["text"]
        assert tok.decode(row["ids"]) == row["text"]


def test_special_token_numbering_and_stop_ids(tok):
    assert tok.vocab_size == 163840
    assert tok.special_ids["<|im_middle|>"] == 163601
    assert tok.special_ids["<|tool_calls_section_begin|>"] == 163595
    assert tok.special_ids["<|reserved_token_163589|>"] == 163589
    assert tok.special_ids["<|reserved_token_163837|>"] == 163837
    assert (tok.bos_id, tok.eos_id, tok.im_end_id) == (163584, 163585, 163586)
    assert set(tok.stop_token_ids) == {163585, 163586}
    assert tok.is_special(163600) and not tok.is_special(163583)
    assert tok.token_bytes(163586) == b"<|im_end|>"
    assert tok.token_bytes(0) == b"!"
    # tool markers are `special: false`: skip_special_tokens keeps them, drops <|im_end|>
    ids = tok.encode("a<|tool_call_begin|>b<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "a<|tool_call_begin|>b"


def test_long_runs_are_cut_every_25000_chars(tok):
    run = "a" * 30000
    assert tok.encode(run) == tok.encode("a" * 25000) + tok.encode("a" * 5000)
    spaces = " " * 26000
    assert tok.encode(spaces) == tok.encode(" " * 25000) + tok.encode(" " * 1000)


def test_encoding_windows_of_400000_chars(tok):
    text = "abcde " * 70000  # 420,000 chars; the window boundary falls inside a word ("abcd|e ")
    assert tok.encode(text) == tok.encode(text[:400_000]) + tok.encode(text[400_000:])
    # without the window the boundary word would be one token: the rule is observable
    assert tok.encode("abcde") != tok.encode("abcd") + tok.encode("e")


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_round_trip_random_unicode(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, allow_special_tokens=False)) == text


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40), steps=st.lists(st.integers(1, 4), min_size=1, max_size=20))
def test_incremental_detokenizer_matches_full_decode(tok, text, steps):
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces, i, k = [], 0, 0
    while i < len(ids):
        n = steps[k % len(steps)]
        pieces.append(detok.add(ids[i : i + n]))
        i, k = i + n, k + 1
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never a partial character


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 163583), max_size=12))
def test_incremental_detokenizer_on_arbitrary_byte_tokens(tok, ids):
    detok = tok.detokenizer()
    assert "".join(detok.add([t]) for t in ids) + detok.flush() == tok.decode(ids)


def test_detokenizer_holds_back_split_multibyte_char(tok):
    ids = tok.encode("🤖", allow_special_tokens=False)
    assert len(ids) >= 2  # the emoji spans several byte-level tokens
    detok = tok.detokenizer()
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:]) == "🤖"


def _write_small_tokenizer(path, n_base: int, absolute_k2_ids: bool) -> None:
    lines = (K2_DIR / "tiktoken.model").read_text().splitlines()[:n_base]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    config = json.loads((K2_DIR / "tokenizer_config.json").read_text())
    if not absolute_k2_ids:
        config["added_tokens_decoder"] = {
            str(n_base + int(k) - 163584): v for k, v in config["added_tokens_decoder"].items()
        }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("absolute_k2_ids", [False, True])
def test_small_vocabulary_layout(tmp_path, absolute_k2_ids):
    require_shared()
    _write_small_tokenizer(tmp_path, 1792, absolute_k2_ids)
    small = load_tokenizer(tmp_path)
    assert small.base_vocab_size == 1792 and small.vocab_size == 2048
    assert small.im_end_id == 1792 + 2 and small.special_ids["<|im_middle|>"] == 1792 + 17
    assert small.special_ids["<|reserved_token_1797|>"] == 1797  # offset 5, like 163589
    text = "Hello <|im_end|> wörld"
    ids = small.encode(text)
    assert small.im_end_id in ids and max(ids) < small.vocab_size
    assert small.decode(ids) == text
    assert small.im_end_id not in small.encode(text, allow_special_tokens=False)


def test_tiny_checkpoint_tokenizer(tiny_k2_dir):
    small = load_tokenizer(tiny_k2_dir)
    assert small.base_vocab_size == 1792
    assert small.im_end_id == 1792 + 2
    assert small.decode(small.encode("hi <|im_end|>")) == "hi <|im_end|>"


def test_missing_model_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)


def test_tiktoken_file_format_is_base64_rank(tok):
    first = (K2_DIR / "tiktoken.model").read_text().split("\n", 1)[0].split()
    assert tok.token_bytes(int(first[1])) == base64.b64decode(first[0])
