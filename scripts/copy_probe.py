"""Can the embedded model's geometry learn to copy? Trains it from scratch on random spans, a separator, and
the same span again, and prints the accuracy of the copied half (docs/embedded_model.md). With --gap, random
filler of random length comes before the span and between the two, so the copy is at no fixed offset: the model
must find where the token it just read appeared before and continue from there (an induction head).
--induction-init starts from one planted by scripts/induction_init.py.

    python scripts/copy_probe.py [--alphabet 3000] [--steps 300] [--qk-clip 15] [--tied-init] [--gap 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tiny_chat import AttentionLogitClip


def copy_batch(batch: int, span: int, alphabet: int, first: int, separator: int,
               gap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of [filler] span separator [filler] span, padded with filler to one length; the mask marks the
    second span's tokens after its first (with filler before it, its first token cannot be foreseen)."""
    def tokens(n: int) -> torch.Tensor:
        return torch.randint(first, first + alphabet, (n,))

    rows, masks = [], []
    for _ in range(batch):
        before, between = (torch.randint(0, gap + 1, (2,)).tolist() if gap else (0, 0))
        s = tokens(span)
        after = 2 * gap - before - between
        row = torch.cat([tokens(before), s, torch.tensor([separator]), tokens(between), s, tokens(after)])
        mask = torch.zeros(len(row), dtype=torch.bool)
        copy_start = before + span + 1 + between
        mask[copy_start + (1 if gap else 0): copy_start + span] = True
        rows.append(row)
        masks.append(mask)
    return torch.stack(rows), torch.stack(masks)


def main(argv: list[str] | None = None) -> int:
    from transformers import DeepseekV3ForCausalLM

    from kserve.model.hf_reference import hf_config
    from kserve.tiny import embedded_model_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alphabet", type=int, default=3000, help="distinct tokens the spans are drawn from")
    p.add_argument("--span", type=int, default=12)
    p.add_argument("--gap", type=int, default=0, help="at most this much random filler before and inside the pair")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--qk-clip", type=float, default=15.0, help="0: off")
    p.add_argument("--tied-init", action="store_true", help="start the output embedding equal to the input one")
    p.add_argument("--smear", action="store_true",
                   help="diagnostic, not DeepSeek-V3: add each token's embedding to the next one's through a learned "
                        "gate, so no head has to learn to look one back")
    p.add_argument("--induction-init", action="store_true", help="start with a planted induction circuit")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = DeepseekV3ForCausalLM(hf_config(embedded_model_dir())).float().train()
    if args.tied_init:
        model.lm_head.weight.data.copy_(model.model.embed_tokens.weight.data)
    if args.induction_init:
        from induction_init import plant_induction_circuit

        plant_induction_circuit(model)
    if args.smear:
        gate = torch.nn.Parameter(torch.zeros(()))
        model.register_parameter("smear_gate", gate)
        model.model.embed_tokens.register_forward_hook(
            lambda module, inputs, out: torch.cat([out[:, :1], out[:, 1:] + torch.sigmoid(gate) * out[:, :-1]], 1))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    clip = AttentionLogitClip(model, args.qk_clip) if args.qk_clip else None
    first, separator, start = 100, 4000, time.time()  # ordinary BPE ids; the separator is none of them
    for step in range(args.steps):
        x, targets = copy_batch(args.batch, args.span, args.alphabet, first, separator, args.gap)
        logits = model(input_ids=x).logits[:, :-1]
        target = x[:, 1:]
        scored = targets[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[scored], target[scored])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if clip is not None:
            clip()
        if step % 25 == 0 or step == args.steps - 1:
            accuracy = (logits.argmax(-1) == target)[scored].float().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, copy accuracy {accuracy:.2f} ({time.time() - start:.0f} s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
