"""Byte-level BPE as K2's tiktoken.model ranks it, learned deterministically from a small embedded corpus."""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from itertools import pairwise

from kserve.chat.tokenizer import K2_PAT_STR

BASE_VOCAB = 1792  # tokens in the tiny tiktoken.model

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
def learn_bpe_ranks(vocab_size: int = BASE_VOCAB, corpus: str = TRAINING_CORPUS) -> tuple[bytes, ...]:
    """Byte-level BPE tokens, in rank order, learned deterministically from `corpus` (default: the
    embedded one; the trained chat model learns its own from its training conversations).

    Ties between equally frequent pairs go to the lexicographically smaller merged bytes.
    """
    import regex

    pattern = regex.compile(K2_PAT_STR, regex.V1)
    word_freq = Counter(m.encode("utf-8") for m in pattern.findall(corpus))
    vocab: list[bytes] = [bytes([b]) for b in _gpt2_byte_order()]
    known = set(vocab)
    byte_id = {tok[0]: i for i, tok in enumerate(vocab)}
    words = [[byte_id[b] for b in w] for w in sorted(word_freq)]
    freqs = [word_freq[w] for w in sorted(word_freq)]
    pair_count: Counter = Counter()
    pair_words: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, word in enumerate(words):
        for pair in pairwise(word):
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
            for pair in pairwise(word):
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
            for pair in pairwise(out):
                pair_count[pair] += f
                pair_words[pair].add(wi)
        pair_count.pop((a, b), None)
    return tuple(vocab)
