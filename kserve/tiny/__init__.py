"""Tiny Kimi K2 models: random checkpoints for tests (`kserve make-tiny`) and the trained embedded chat model.

Modules, one job each: `bpe` (the byte-level BPE trainer and its corpus), `tokenizer_files`
(K2-format tiktoken.model and tokenizer_config.json), `checkpoint` (config and FP8 or INT4 safetensors in
Moonshot's layouts), `embedded` (the trained K2.6-format chat model shipped in the package, the default model).
"""

from kserve.chat.tokenizer import K2_PAT_STR
from kserve.tiny.bpe import BASE_VOCAB, TRAINING_CORPUS, learn_bpe_ranks
from kserve.tiny.checkpoint import (
    GEOMETRIES,
    VARIANTS,
    tiny_config,
    write_tiny_checkpoint,
)
from kserve.tiny.embedded import EMBEDDED_MODEL_NAME, embedded_model_dir
from kserve.tiny.tokenizer_files import (
    K2_FIRST_SPECIAL,
    K2_NAMED_SPECIAL_TOKENS,
    NUM_SPECIAL,
    special_token_id,
    tiktoken_model_text,
    tokenizer_config,
)

__all__ = [
    "BASE_VOCAB", "EMBEDDED_MODEL_NAME", "GEOMETRIES", "K2_FIRST_SPECIAL", "K2_NAMED_SPECIAL_TOKENS", "K2_PAT_STR",
    "NUM_SPECIAL", "TRAINING_CORPUS", "VARIANTS", "embedded_model_dir", "learn_bpe_ranks", "special_token_id",
    "tiktoken_model_text", "tiny_config", "tokenizer_config", "write_tiny_checkpoint",
]
