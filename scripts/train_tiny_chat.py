"""Train the tiny K2 on synthetic tool-use conversations and write it in K2's published layout.

    python scripts/train_tiny_chat.py --out /tmp/tiny-chat --steps 3000 --seed 0

Plain torch on the CPU: the model is transformers' DeepseekV3ForCausalLM (the same architecture and
the geometry of `kserve make-tiny`, with K2's 131,072-token YaRN context), trained only on the
assistant turns of conversations from scripts/gen_tool_data.py. The result is quantized to FP8
128x128 blocks and written with make-tiny's tokenizer files, so kserve loads it like any K2
checkpoint. A progress bar shows the loss; `loss.png` (and `train_log.json`) in the output directory
record the curve. Same seed, same arguments => the same weights (single-threaded determinism aside).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_tool_data import generate

# K2's context: YaRN factor 32 over 4,096 original positions.
K2_CONTEXT = {"max_position_embeddings": 131072,
              "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}}


def model_config(base: dict[str, Any]) -> dict[str, Any]:
    return {**base, **K2_CONTEXT}


def encode_conversation(tokenizer: Any, text: str, spans: list[list[int]]) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 mask of the tokens to learn (the assistant spans). Spans begin and end at
    control tokens, so encoding piece by piece gives the same ids as encoding the whole text."""
    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for start, end in spans:
        for piece, learn in ((text[cursor:start], 0), (text[start:end], 1)):
            if piece:
                piece_ids = tokenizer.encode(piece, allow_special_tokens=True)
                ids += piece_ids
                mask += [learn] * len(piece_ids)
        cursor = end
    if cursor < len(text):
        tail = tokenizer.encode(text[cursor:], allow_special_tokens=True)
        ids += tail
        mask += [0] * len(tail)
    return ids, mask


def pack(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy packing of whole conversations into rows of seq_len (longer ones are cut)."""
    rows_ids, rows_mask = [], []
    cur_ids: list[int] = []
    cur_mask: list[int] = []
    for ids, mask in examples:
        ids, mask = ids[:seq_len], mask[:seq_len]
        if len(cur_ids) + len(ids) > seq_len:
            rows_ids.append(cur_ids + [pad_id] * (seq_len - len(cur_ids)))
            rows_mask.append(cur_mask + [0] * (seq_len - len(cur_mask)))
            cur_ids, cur_mask = [], []
        cur_ids += ids
        cur_mask += mask
    if cur_ids:
        rows_ids.append(cur_ids + [pad_id] * (seq_len - len(cur_ids)))
        rows_mask.append(cur_mask + [0] * (seq_len - len(cur_mask)))
    return torch.tensor(rows_ids), torch.tensor(rows_mask)


def export_checkpoint_tensors(model: torch.nn.Module, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> K2 checkpoint tensors (per-expert gate/up/down, FP8 blocks + scales)."""
    from kserve.config import ModelConfig
    from kserve.kernels.fp8_dequant import quantize_blocks_torch
    from kserve.model.weights_layout import BF16, FP8, checkpoint_tensors

    config = ModelConfig.from_dict(cfg)
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    inter = config.moe_intermediate_size

    def dense(name: str) -> torch.Tensor:
        if name in state:
            return state[name]
        parts = name.split(".")  # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
        prefix, e, proj = ".".join(parts[:5]), int(parts[5]), parts[6]
        if proj == "down_proj":
            return state[f"{prefix}.down_proj"][e]
        gate_up = state[f"{prefix}.gate_up_proj"][e]
        return gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]

    out: dict[str, torch.Tensor] = {}
    block = tuple(config.quantization_config.weight_block_size)
    for spec in checkpoint_tensors(config):
        w = dense(spec.name)
        if spec.kind == FP8:
            out[spec.name], out[spec.scale_name] = quantize_blocks_torch(w, block)
        else:
            out[spec.name] = w.to(torch.bfloat16 if spec.kind == BF16 else torch.float32)
    return out


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> Path:
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import DeepseekV3ForCausalLM

    from kserve.chat import load_tokenizer
    from kserve.model.hf_reference import hf_config
    from kserve.tiny import tiny_config, write_tiny_checkpoint

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    # make-tiny writes the tokenizer files and config; the weights are then replaced by trained ones
    cfg = model_config(tiny_config("k2"))
    write_tiny_checkpoint(out, seed=args.seed, config_overrides=K2_CONTEXT)
    tokenizer = load_tokenizer(out)
    pad_id = cfg["eos_token_id"]

    convos = generate(args.seed, args.conversations, "train", thinking=args.thinking)
    examples = [encode_conversation(tokenizer, c["text"], c["spans"]) for c in convos]
    ids, mask = pack(examples, args.seq_len, pad_id)
    print(f"{len(convos)} conversations, {ids.numel()} tokens in {ids.shape[0]} rows of {args.seq_len}; "
          f"{int(mask.sum())} trained tokens")

    model = DeepseekV3ForCausalLM(hf_config(out)).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    log: list[dict[str, float]] = []
    start = time.time()
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for step in bar:
        if args.time_limit and time.time() - start > args.time_limit:
            print(f"time limit reached at step {step}")
            break
        rows = torch.randint(0, ids.shape[0], (args.batch,), generator=gen)
        x, m = ids[rows], mask[rows]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        logits = model(input_ids=x).logits[:, :-1].float()
        target, weight = x[:, 1:], m[:, 1:].float()
        loss_tok = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        loss = (loss_tok * weight.reshape(-1)).sum() / weight.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append({"step": step, "loss": loss.item(), "seconds": time.time() - start})
        bar.set_postfix(loss=f"{log[-1]['loss']:.3f}")

    tensors = export_checkpoint_tensors(model, cfg)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    for f in files:
        save_file({n: t.contiguous() for n, t in tensors.items() if index["weight_map"][n] == f}, str(out / f),
                  metadata={"format": "pt"})
    (out / "train_log.json").write_text(json.dumps({"args": vars(args), "log": log}, indent=1))
    _plot(log, out / "loss.png")
    return out


def _plot(log: list[dict[str, float]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss.png")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in log], [r["loss"] for r in log], lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (assistant tokens)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=20000)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--thinking", action="store_true")
    p.add_argument("--time-limit", type=float, default=0.0, help="stop after this many seconds (0: none)")
    args = p.parse_args(argv)
    print(train(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
