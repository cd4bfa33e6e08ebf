"""Can the embedded model's geometry learn to copy? Trains it from scratch on random spans, a separator, and
the same span again, and prints the accuracy of the copied half (docs/embedded_model.md).

    python scripts/copy_probe.py [--alphabet 3000] [--steps 300] [--qk-clip 15] [--tied-init]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tiny_chat import AttentionLogitClip


def main(argv: list[str] | None = None) -> int:
    from transformers import DeepseekV3ForCausalLM

    from kserve.model.hf_reference import hf_config
    from kserve.tiny import embedded_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alphabet", type=int, default=3000, help="distinct tokens the spans are drawn from")
    p.add_argument("--span", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--qk-clip", type=float, default=15.0, help="0: off")
    p.add_argument("--tied-init", action="store_true", help="start the output embedding equal to the input one")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = DeepseekV3ForCausalLM(hf_config(embedded_model_dir())).float().train()
    if args.tied_init:
        model.lm_head.weight.data.copy_(model.model.embed_tokens.weight.data)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    clip = AttentionLogitClip(model, args.qk_clip) if args.qk_clip else None
    first, separator, start = 100, 4000, time.time()  # ordinary BPE ids; the separator is none of them
    for step in range(args.steps):
        span = torch.randint(first, first + args.alphabet, (args.batch, args.span))
        x = torch.cat([span, torch.full((args.batch, 1), separator), span], 1)
        logits = model(input_ids=x).logits[:, args.span:-1]
        target = x[:, args.span + 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if clip is not None:
            clip()
        if step % 25 == 0 or step == args.steps - 1:
            accuracy = (logits.argmax(-1) == target).float().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, copy accuracy {accuracy:.2f} ({time.time() - start:.0f} s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
