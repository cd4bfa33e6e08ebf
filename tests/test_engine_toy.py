"""A toy paged-attention model (and char tokenizer) for engine tests that must not depend on the
real model: one attention-like mixing per layer over the sequence's context, read back from the
paged cache through block tables and slot mappings, so a wrong slot or block table changes outputs.
Also checks the toy itself: paged, chunked computation equals computing the whole sequence at once.
"""

from __future__ import annotations

import torch

from kserve.config import EngineConfig, ModelConfig
from kserve.engine.llm_engine import LLMEngine
from kserve.model.forward_batch import ForwardBatch

TOY_VOCAB = 128


class ToyModel(torch.nn.Module):
    def __init__(self, vocab: int = TOY_VOCAB, dim: int = 16, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.config = ModelConfig(
            vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers, kv_lora_rank=dim - 4,
            qk_rope_head_dim=4, max_position_embeddings=4096, eos_token_id=None, bos_token_id=None,
        )
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
        self.pos = torch.randn(4096, dim, generator=g, dtype=torch.float64) * 0.3
        self.mix = torch.randn(layers, dim, dim, generator=g, dtype=torch.float64) / dim**0.5
        self.head = torch.randn(dim, vocab, generator=g, dtype=torch.float64) * 2
        self.calls = 0
        self.tokens_computed = 0

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.tokens_computed += int(input_ids.shape[0])
        x = self.embed[input_ids] + self.pos[batch.positions]
        num_layers, _, bs, dim = kv_cache.shape
        for layer in range(num_layers):
            flat = kv_cache[layer].view(-1, dim)
            flat[batch.slot_mapping] = x.to(flat.dtype)
            out = torch.empty_like(x)
            start = 0
            for i, (q, ctx) in enumerate(zip(batch.query_lens, batch.context_lens_host)):
                table = batch.block_tables[i].long()
                slots = table[torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs
                keys = flat[slots].to(torch.float64)  # [ctx, dim]
                queries = x[start : start + q]
                scores = queries @ keys.T / dim**0.5
                qpos = torch.arange(ctx - q, ctx).unsqueeze(1)
                scores = scores.masked_fill(torch.arange(ctx).unsqueeze(0) > qpos, float("-inf"))
                out[start : start + q] = torch.softmax(scores, -1) @ keys
                start += q
            x = x + torch.tanh(out @ self.mix[layer])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head).float()


class CharTokenizer:
    """Token id i <-> chr(i); ids 1 and 2 are special stop tokens that decode to nothing."""

    stop_token_ids = (1, 2)
    eos_id = 1
    vocab_size = TOY_VOCAB

    def encode(self, text: str, allow_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i > 2)

    def detokenizer(self, skip_special_tokens: bool = False) -> CharDetokenizer:
        return CharDetokenizer(self)


class CharDetokenizer:
    def __init__(self, tok: CharTokenizer) -> None:
        self.tok = tok

    def add(self, token_ids: list[int]) -> str:
        return self.tok.decode(token_ids)

    def flush(self) -> str:
        return ""


def make_toy_engine(
    num_kv_blocks: int = 256, block_size: int = 4, tokenizer=None, **knobs
) -> LLMEngine:
    model = ToyModel()
    config = EngineConfig(num_kv_blocks=num_kv_blocks, block_size=block_size, **knobs)
    return LLMEngine(model, model.config, tokenizer, config)


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for request in engine.step():
            if request.finished:
                outputs[request.request_id] = request.output()
    assert not engine.has_unfinished(), "engine did not finish"
    return outputs


def test_toy_model_paged_chunks_equal_whole_sequence() -> None:
    model = ToyModel()
    tokens = torch.randint(0, TOY_VOCAB, (23,), generator=torch.Generator().manual_seed(1))
    cache = torch.zeros(2, 16, 4, 16)
    whole = ForwardBatch.contiguous([23], [23], 4)
    ref = model(tokens, whole, cache.clone())
    cache2 = torch.zeros(2, 16, 4, 16)
    a = ForwardBatch.contiguous([10], [10], 4)
    model(tokens[:10], a, cache2)
    b = ForwardBatch.contiguous([13], [23], 4)
    got = model(tokens[10:], b, cache2)
    torch.testing.assert_close(got, ref[10:])
