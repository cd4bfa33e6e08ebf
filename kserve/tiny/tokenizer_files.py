"""K2-format tokenizer files for the tiny model: `tiktoken.model` text and `tokenizer_config.json`
with K2's special-token layout shifted to follow the tiny base vocabulary."""

from __future__ import annotations

import base64
from typing import Any

from kserve.tiny.bpe import BASE_VOCAB

NUM_SPECIAL = 256  # K2 reserves 256 ids after the base vocabulary
K2_FIRST_SPECIAL = 163584

# K2's named special tokens (tokenizer_config.json's added_tokens_decoder) by K2 id, with their `special` flag.
K2_NAMED_SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (163584, "[BOS]", True),
    (163585, "[EOS]", True),
    (163586, "<|im_end|>", True),
    (163587, "<|im_user|>", True),
    (163588, "<|im_assistant|>", True),
    (163590, "<|start_header_id|>", True),
    (163591, "<|end_header_id|>", True),
    (163593, "[EOT]", True),
    (163594, "<|im_system|>", True),
    (163595, "<|tool_calls_section_begin|>", False),
    (163596, "<|tool_calls_section_end|>", False),
    (163597, "<|tool_call_begin|>", False),
    (163598, "<|tool_call_argument_begin|>", False),
    (163599, "<|tool_call_end|>", False),
    (163601, "<|im_middle|>", True),
    (163838, "[UNK]", True),
    (163839, "[PAD]", True),
)
# What K2.5 / K2.6's tokenizer_config.json adds: the media tokens (special) and <think> / </think> (not special).
K25_EXTRA_SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (163602, "<|media_begin|>", True),
    (163603, "<|media_content|>", True),
    (163604, "<|media_end|>", True),
    (163605, "<|media_pad|>", True),
    (163606, "<think>", False),
    (163607, "</think>", False),
)


def tiktoken_model_text(ranks: tuple[bytes, ...]) -> str:
    return "".join(f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(ranks))


def special_token_id(k2_id: int, base_vocab: int = BASE_VOCAB) -> int:
    return base_vocab + (k2_id - K2_FIRST_SPECIAL)


def tokenizer_config(base_vocab: int = BASE_VOCAB, k25: bool = False) -> dict[str, Any]:
    """K2's tokenizer_config.json (`k25`: K2.5 / K2.6's, with the media and think tokens) with special ids
    shifted to follow this base vocabulary.

    `auto_map` is left out: it names K2's tokenization_kimi.py, which is not shipped here.
    """
    named = K2_NAMED_SPECIAL_TOKENS + (K25_EXTRA_SPECIAL_TOKENS if k25 else ())
    decoder = {
        str(special_token_id(k2_id, base_vocab)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for k2_id, content, special in sorted(named)
    }
    media = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"] if k25 else []
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [
            "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
            "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>", *media,
        ],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
