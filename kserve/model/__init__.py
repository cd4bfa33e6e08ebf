"""The Kimi K2 / DeepSeek-V3 model: `load_model(dir)` -> `KimiK2ForCausalLM`."""

from kserve.model.deepseek_v3 import KimiK2ForCausalLM, kv_cache_bytes_per_token
from kserve.model.forward_batch import ForwardBatch
from kserve.model.loader import CheckpointError, load_model

__all__ = ["CheckpointError", "ForwardBatch", "KimiK2ForCausalLM", "kv_cache_bytes_per_token", "load_model"]
