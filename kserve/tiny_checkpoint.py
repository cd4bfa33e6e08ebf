"""A tiny random Kimi K2 checkpoint in Moonshot's published layout, for tests and CPU serving.

`write_tiny_checkpoint(dir, seed, variant)` writes config.json, generation_config.json, FP8
safetensors shards with their index, and K2-format tokenizer files (a `tiktoken.model` learned
here by byte-level BPE on a small embedded corpus, and a `tokenizer_config.json` with K2's special
token layout shifted to this vocabulary). The same seed gives byte-identical files.
`ensure_embedded_model()` builds the default one once in the cache directory.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from kserve.chat.tokenizer import K2_PAT_STR

BASE_VOCAB = 1792  # tokens in tiktoken.model
NUM_SPECIAL = 256  # K2 reserves 256 ids after the base vocabulary
K2_FIRST_SPECIAL = 163584
EMBEDDED_MODEL_NAME = "tiny-k2-v1"

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

TRAINING_CORPUS = r'''
The quick brown fox jumps over the lazy dog. A language model reads text as a sequence of tokens and
predicts the next one. You are Kimi, an AI assistant created by Moonshot AI. The user asked a question
about the weather in Beijing, and the assistant answered with a short, helpful reply. Please think step
by step, then give the final answer. What is the capital of France? The capital of France is Paris.
How many days are there in a week? There are seven days in a week: Monday, Tuesday, Wednesday,
Thursday, Friday, Saturday and Sunday. Numbers like 0, 1, 2, 3, 10, 42, 100, 256, 1024, 2025 and
3.14159 appear often. It's a good idea to write tests; they're cheap, and we'll thank ourselves later.
I'd say the server should stream tokens as soon as they're ready, and it shouldn't crash on bad input.
Mixture of experts layers route every token to a few experts; attention compresses keys and values into
a small latent vector. Temperature, top_p, top_k, presence penalty and frequency penalty change sampling.
Hello, world! Good morning. Thank you very much. Sorry, I don't know. Yes, no, maybe, of course.
Once upon a time there was a little robot who loved to read books about history, science and music.
Every evening it would sit by the window, watch the rain, and count the drops one by one until sleep.

Science explains natural phenomena through observation, experiment and careful reasoning. Biology
studies living organisms; chemistry studies molecules and reactions; physics studies energy, matter,
motion, gravity, electricity, magnetism and light. Mathematics provides the language: algebra,
geometry, calculus, probability, statistics, topology and number theory. Historians examine ancient
civilizations, empires, revolutions, wars, treaties, migrations and economic transformations.
Musicians practise scales, rhythms, harmonies and melodies; painters mix colours on canvas.
Engineers design bridges, engines, networks, processors, compilers, databases and operating systems.
Doctors diagnose illnesses, prescribe medicine, perform surgery and encourage healthy habits.
Farmers harvest wheat, barley, potatoes, tomatoes, apples, oranges, grapes and strawberries.
import os
from pathlib import Path
from typing import Optional, List, Dict
async def handle(request: Request) -> Response:
    try:
        payload = await request.json()
    except ValueError as error:
        raise HTTPException(status_code=400, detail=str(error))
    while True:
        yield {"delta": payload.get("content", ""), "finish_reason": None}
#include <stdio.h>
int main(int argc, char **argv) { printf("%d\n", argc); return 0; }
fn main() { let mut v: Vec<u32> = Vec::new(); v.push(7); println!("{:?}", v); }

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Request:
    def __init__(self, prompt, max_tokens=16, temperature=0.0):
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.temperature = temperature

if __name__ == "__main__":
    import json, sys
    print(json.dumps({"result": fibonacci(10)}))
    for line in sys.stdin:
        print(line.strip().upper())

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message;
}

{"model": "kimi-k2", "messages": [{"role": "system", "content": "You are a helpful assistant."},
 {"role": "user", "content": "What's the weather like in Beijing today?"}], "stream": true,
 "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
 "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
 "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}], "max_tokens": 128, "temperature": 0.6}
{"id": "chatcmpl-123", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
 "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "functions.get_weather:0",
 "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Beijing\"}"}}]}}],
 "usage": {"prompt_tokens": 42, "completion_tokens": 7, "total_tokens": 49}}

SELECT name, count(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY count DESC;
<html><body><h1>Title</h1><p>Paragraph with <b>bold</b> text.</p></body></html>
$ pip install -e ".[test]" && pytest -q tests/

你好，世界！今天天气怎么样？我们一起去公园散步吧。人工智能正在改变世界。北京是中国的首都。
谢谢你的帮助。这个模型可以回答问题、写代码和翻译文章。
Bonjour le monde ! Ça va très bien, merci. Où est la bibliothèque ? L'été dernier, nous sommes allés à la mer.
Grüße aus München: Die Straße ist schön, und das Wetter ist heute großartig. Übung macht den Meister.
¿Dónde está la estación? El niño comió una manzana. Mañana será otro día.
Привет, мир! Как дела? Спасибо большое. Москва — столица России.
こんにちは世界。ありがとうございます。東京は日本の首都です。
안녕하세요 세계! 감사합니다. 😀 🚀 ✨ → ← ✓ ∑ π ≈ ≠ ∞ € £ ¥ © ® ° ± × ÷
'''


def _gpt2_byte_order() -> list[int]:
    """The 256 bytes in GPT-2's order (printable ranges first), as K2's ranks 0..255 are."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    return printable + [b for b in range(256) if b not in printable]


@functools.lru_cache(maxsize=4)
def learn_bpe_ranks(vocab_size: int = BASE_VOCAB) -> tuple[bytes, ...]:
    """Byte-level BPE tokens, in rank order, learned deterministically from the embedded corpus.

    Ties between equally frequent pairs go to the lexicographically smaller merged bytes.
    """
    import regex

    pattern = regex.compile(K2_PAT_STR, regex.V1)
    word_freq = Counter(m.encode("utf-8") for m in pattern.findall(TRAINING_CORPUS))
    vocab: list[bytes] = [bytes([b]) for b in _gpt2_byte_order()]
    known = set(vocab)
    byte_id = {tok[0]: i for i, tok in enumerate(vocab)}
    words = [[byte_id[b] for b in w] for w in sorted(word_freq)]
    freqs = [word_freq[w] for w in sorted(word_freq)]
    pair_count: Counter = Counter()
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_count[pair] += freqs[wi]
            pair_words[pair].add(wi)

    while len(vocab) < vocab_size:
        candidates = [(-n, vocab[a] + vocab[b], a, b) for (a, b), n in pair_count.items() if n > 0]
        if not candidates:
            raise RuntimeError(f"training corpus too small for {vocab_size} tokens (got {len(vocab)})")
        _, merged, a, b = min(candidates)
        if merged in known:
            new_id = vocab.index(merged)
        else:
            new_id = len(vocab)
            vocab.append(merged)
            known.add(merged)
        for wi in sorted(pair_words.pop((a, b), ())):
            word, f = words[wi], freqs[wi]
            for pair in zip(word, word[1:]):
                pair_count[pair] -= f
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            words[wi] = out
            for pair in zip(out, out[1:]):
                pair_count[pair] += f
                pair_words[pair].add(wi)
        pair_count.pop((a, b), None)
    return tuple(vocab)


def tiktoken_model_text(ranks: tuple[bytes, ...]) -> str:
    return "".join(f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(ranks))


def special_token_id(k2_id: int, base_vocab: int = BASE_VOCAB) -> int:
    return base_vocab + (k2_id - K2_FIRST_SPECIAL)


def tokenizer_config(base_vocab: int = BASE_VOCAB) -> dict[str, Any]:
    """K2's tokenizer_config.json with special ids shifted to follow this base vocabulary.

    `auto_map` is left out: it names K2's tokenization_kimi.py, which is not shipped here.
    """
    decoder = {
        str(special_token_id(k2_id, base_vocab)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for k2_id, content, special in K2_NAMED_SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [
            "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
            "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>",
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


def tiny_config(variant: str = "k2") -> dict[str, Any]:
    """config.json with K2's keys and tiny sizes. `v3` uses group-limited routing like DeepSeek-V3."""
    if variant not in ("k2", "v3"):
        raise ValueError(f"unknown tiny variant {variant!r}; expected 'k2' or 'v3'")
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": special_token_id(163584),
        "eos_token_id": special_token_id(163585),
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "kv_lora_rank": 128,
        "max_position_embeddings": 8192,
        "model_type": "kimi_k2",
        "moe_intermediate_size": 128,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 8,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": 192,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,  # kv_a_proj_with_mqa out = 128 + 32 = 160: a ragged FP8 block
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 256,
            "type": "yarn",
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.3",
        "use_cache": True,
        "v_head_dim": 32,
        "vocab_size": BASE_VOCAB + NUM_SPECIAL,
    }
    if variant == "v3":
        cfg.update(model_type="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_theta=10000.0,
                   max_position_embeddings=10240)  # = factor x original, as transformers expects
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], beta_fast=32.0, factor=40.0)
    return cfg


def _random_weights(config_dict: dict[str, Any], seed: int) -> dict[str, Any]:
    """Checkpoint tensors (FP8 + scales, bf16, fp32) drawn from `seed`, in checkpoint order."""
    import torch

    from kserve.config import ModelConfig
    from kserve.kernels.fp8_dequant import quantize_blocks_torch
    from kserve.model.weights_layout import BF16, FP8, checkpoint_tensors

    config = ModelConfig.from_dict(config_dict)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for spec in checkpoint_tensors(config):
        name, shape = spec.name, spec.shape
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("e_score_correction_bias"):
            out[name] = (0.05 * noise).float()
        elif len(shape) == 1:  # norms
            out[name] = (1.0 + 0.1 * noise).to(torch.bfloat16)
        elif name == "model.embed_tokens.weight":
            out[name] = noise.to(torch.bfloat16)
        elif name == "lm_head.weight":
            out[name] = (noise * (3.0 / shape[1] ** 0.5)).to(torch.bfloat16)
        else:
            w = noise / shape[1] ** 0.5
            if spec.kind == FP8:
                q, scale = quantize_blocks_torch(w, tuple(config.quantization_config.weight_block_size))
                out[name] = q
                out[spec.scale_name] = scale
            else:
                out[name] = w.to(torch.bfloat16 if spec.kind == BF16 else torch.float32)
    return out


def _shard_of(name: str, num_layers: int) -> int:
    """Shard 1: embeddings and the first half of the layers; shard 2: the rest, norm and lm_head."""
    from kserve.model.weights_layout import layer_index

    if name == "model.embed_tokens.weight":
        return 1
    idx = layer_index(name)
    return 1 if idx is not None and idx < num_layers // 2 else 2


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_checkpoint(
    dir: str | os.PathLike, seed: int = 0, variant: str = "k2", config_overrides: dict[str, Any] | None = None
) -> Path:
    """Write a complete tiny model directory; returns its path.

    `config_overrides` replaces config.json keys (sizes), e.g. for a larger model in benchmarks.
    """
    from safetensors.torch import save_file

    out_dir = Path(dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {**tiny_config(variant), **(config_overrides or {})}
    tensors = _random_weights(cfg, seed)
    num_shards = 2
    shards: dict[int, dict[str, Any]] = {i: {} for i in range(1, num_shards + 1)}
    for name, t in tensors.items():
        base = name[: -len("_scale_inv")] if name.endswith("_scale_inv") else name
        shards[_shard_of(base, cfg["num_hidden_layers"])][name] = t
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in shards.items():
        file = f"model-{i}-of-{num_shards}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        os.chmod(out_dir / file, 0o644)  # safetensors writes through a private temp file
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    _write_json(out_dir / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(out_dir / "config.json", dict(sorted(cfg.items())))
    _write_json(out_dir / "generation_config.json",
                {"max_length": cfg["max_position_embeddings"], "eos_token_id": special_token_id(163586)})
    (out_dir / "tiktoken.model").write_text(tiktoken_model_text(learn_bpe_ranks()), encoding="ascii")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    return out_dir


def ensure_embedded_model() -> Path:
    """The default tiny model (seed 0, k2) under the cache directory, built once.

    Built in a temporary sibling directory and renamed into place, so concurrent callers never
    see a partial model; a loser of the rename race discards its copy.
    """
    from kserve.config import default_cache_dir

    root = default_cache_dir()
    final = root / EMBEDDED_MODEL_NAME
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_MODEL_NAME}-", dir=root))
    try:
        write_tiny_checkpoint(tmp, seed=0, variant="k2")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
