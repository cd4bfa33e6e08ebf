"""Train the tiny K2.6 on synthetic tool-use conversations and write it in K2.6's published layout.

    python scripts/train_tiny_chat.py --out DIR [--seed 0] [--stop-at N] [--init-from DIR]

transformers' DeepseekV3ForCausalLM on the CPU (make-tiny's K2.6 geometry with 4 heads), AdamW, K2's
QK-Clip, routed experts through INT4 fake quantization; loss weighted toward each assistant turn's
reasoning sentence, tool names and arguments. `--polish-steps N` adds a second stage of N steps without
the planted loops (`--repeat-break-share`), with a fresh optimizer (`--polish-lr`, `--polish-warmup`).
Written as `kimi_k25` + INT4 experts + K2.6 tokenizer files, with `loss.png` and `train_log.json`. The
defaults are the embedded model's recipe (README, "The embedded model"); same arguments, same data,
tokenizer and batch order.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen_tool_data import generate

from kserve.chat.markers import THINK_BEGIN, THINK_END

# make-tiny's K2.6 text config, with half its attention heads: the package stays under 20 MB with K2.6's
# bf16 attention (make-tiny's 8 heads alone would be 14 MB of it).
TEXT_OVERRIDES = {"num_attention_heads": 4, "num_key_value_heads": 4}
INT4_GROUP = 32


_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)


def encode_conversation(tokenizer: Any, text: str, spans: list[list[int]], arguments_weight: float = 1.0,
                        choice_weight: float = 1.0) -> tuple[list[int], list[float]]:
    """Token ids and each token's loss weight: 0 outside the assistant spans, 1 inside, `arguments_weight`
    on a tool call's arguments (the values to copy from the request) and `choice_weight` on the tokens that
    decide what the turn does: its reasoning sentence (which says text or tool, and which tool) and its
    `</think>`, or without reasoning its first token (text or a tool-call section), each called tool's
    name, and the token after each call (another call or the section's end). Every piece begins and ends
    at a control token, so encoding piece by piece gives the same ids as encoding the whole text."""
    call_end = tokenizer.encode("<|tool_call_end|>", allow_special_tokens=True)[0]
    ids: list[int] = []
    weights: list[float] = []

    def add(start: int, end: int, weight: float) -> None:
        if end > start:
            piece_ids = tokenizer.encode(text[start:end], allow_special_tokens=True)
            ids.extend(piece_ids)
            weights.extend([weight] * len(piece_ids))

    cursor = 0
    for start, end in spans:
        add(cursor, start, 0.0)
        first, inner = len(ids), start
        think_end = text.find(THINK_END, start, end)
        if think_end >= 0:  # the reasoning sentence and its </think> decide the turn
            add(start, think_end + len(THINK_END), choice_weight)
            inner = think_end + len(THINK_END)
        after_think = len(ids)
        for m in _CALL.finditer(text, inner, end):
            add(inner, m.start(1), 1.0)
            add(m.start(1), m.end(1), choice_weight)
            add(m.end(1), m.start(2), 1.0)
            add(m.start(2), m.end(2), arguments_weight)
            inner = m.end(2)
        add(inner, end, 1.0)
        for i in (first, after_think):  # the turn's first token and the one after </think>: text or a call
            if i < len(ids):
                weights[i] = choice_weight
        for i in range(first, len(ids) - 1):
            if ids[i] == call_end:
                weights[i + 1] = choice_weight
        cursor = end
    add(cursor, len(text), 0.0)
    return ids, weights


IGNORED = -1.0  # a token that is context for the model but neither trained on nor counted as context


def break_a_repeat(ids: list[int], weights: list[float], think_begin: int, think_end: int,
                   rng: random.Random) -> tuple[list[int], list[float]]:
    """Insert, at a random point of one reasoning sentence, a loop that the model must leave: the span just
    before the point repeated 0-2 times whole and then in part, untrained, after which the sentence resumes.
    The token after the partial repeat is what the span did not continue with, so the model learns that a
    span it has repeated need not go on: a model that copies otherwise loops greedy on its own words."""
    ends = [i for i, t in enumerate(ids) if t == think_end]
    thoughts = [(i, next(e for e in ends if e > i)) for i, t in enumerate(ids[:-1])
                if t == think_begin and weights[i + 1] > 0 and ends and ends[-1] > i]
    thoughts = [(begin, end) for begin, end in thoughts if end - begin > 4]
    if not thoughts:
        return ids, weights
    begin, end = rng.choice(thoughts)
    point = rng.randint(begin + 3, end - 1)  # the loop goes before ids[point]
    span = ids[point - rng.randint(2, min(6, point - begin - 1)): point]
    loop = span * rng.randint(0, 2) + span[: rng.randint(1, len(span) - 1)]
    return ids[:point] + loop + ids[point:], weights[:point] + [IGNORED] * len(loop) + weights[point:]


def length_batches(examples: list[tuple[list[int], list[float]]], max_len: int, batch_tokens: int,
                   pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Whole conversations (never packed together, so a copied value can only come from its own
    conversation), sorted by length into batches of about `batch_tokens` padded tokens each:
    (ids, assistant loss weights, real-token mask)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    batches, group = [], []
    for i in order + [None]:
        width = len(examples[group[-1]][0]) if group else 0
        if i is None or (group and (len(group) + 1) * max(width, len(examples[i][0][:max_len])) > batch_tokens):
            if group:
                width = min(max_len, max(len(examples[j][0]) for j in group))
                ids = torch.full((len(group), width), pad_id)
                weights = torch.zeros((len(group), width))
                real = torch.zeros((len(group), width), dtype=torch.long)
                for row, j in enumerate(group):
                    e_ids, e_weights = examples[j][0][:width], examples[j][1][:width]
                    ids[row, : len(e_ids)] = torch.tensor(e_ids)
                    weights[row, : len(e_weights)] = torch.tensor(e_weights)
                    real[row, : len(e_ids)] = 1
                batches.append((ids, weights, real))
            group = []
        if i is not None:
            group.append(i)
    return batches


_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def learn_corpus_ranks(convos: list[dict[str, Any]], vocab_size: int) -> tuple[bytes, ...]:
    """A BPE learned on the conversations' text (control tokens removed) plus make-tiny's corpus."""
    from kserve.tiny import TRAINING_CORPUS, learn_bpe_ranks

    corpus = "\n".join(_SPECIAL.sub("\n", c["text"]) for c in convos)
    return learn_bpe_ranks(vocab_size, TRAINING_CORPUS + "\n" + corpus)


def unlikelihood(flat_logits: torch.Tensor, ids: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """Token-level unlikelihood (Welleck et al., 2019) summed over the `trained` predictions: -sum log(1 - p)
    over the tokens already in the sequence other than the right one, so a token is not likely merely
    because it came before."""
    width = ids.shape[1]
    at = trained.nonzero().squeeze(1)
    row, pos = at // (width - 1), at % (width - 1)
    earlier = (torch.arange(width)[None] <= pos[:, None]).float()
    seen = torch.zeros(len(at), flat_logits.shape[-1]).scatter_reduce(1, ids[row], earlier, "amax")
    seen.scatter_(1, ids[row, pos + 1][:, None], 0.0)
    p = torch.softmax(flat_logits[at], -1)
    return -(torch.log((1 - p).clamp(min=1e-5)) * seen).sum()


def export_checkpoint_tensors(model: torch.nn.Module, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> K2.6 text-model tensors, named without `language_model.` (per-expert
    gate/up/down as compressed-tensors INT4: packed int32, bf16 group scales, shape; the rest bf16/fp32)."""
    from kserve.config import ModelConfig
    from kserve.kernels.int4_pack import pack_int4, quantize_int4_groups
    from kserve.model.weights_layout import BF16, INT4, checkpoint_tensors

    config = ModelConfig.from_dict(cfg)
    # mid-run (--export-every) the routed experts are still parametrized: their unrounded weights are `.original`
    state = {re.sub(r"parametrizations\.(\w+)\.original$", r"\1", k): v.detach().float()
             for k, v in model.state_dict().items()}
    inter = config.moe_intermediate_size

    def dense(name: str) -> torch.Tensor:
        name = name.removesuffix("_packed")
        if name in state:
            return state[name]
        parts = name.split(".")  # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
        prefix, e, proj = ".".join(parts[:5]), int(parts[5]), parts[6]
        if proj == "down_proj":
            return state[f"{prefix}.down_proj"][e]
        gate_up = state[f"{prefix}.gate_up_proj"][e]
        return gate_up[:inter] if proj == "gate_proj" else gate_up[inter:]

    out: dict[str, torch.Tensor] = {}
    for spec in checkpoint_tensors(config):
        w = dense(spec.name)
        if spec.kind == INT4:
            q, out[spec.scale_name] = quantize_int4_groups(w, config.int4_group_size)
            out[spec.name] = pack_int4(q)
            out[spec.shape_name] = torch.tensor(spec.logical_shape, dtype=torch.int32)
        else:
            out[spec.name] = w.to(torch.bfloat16 if spec.kind == BF16 else torch.float32)
    return out


class FakeInt4(torch.nn.Module):
    """Routed-expert weights [..., out, in] rounded as the export rounds them (kernels/int4_pack.py's
    quantize_int4_groups), with a straight-through gradient."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        from kserve.kernels.int4_pack import quantize_int4_groups

        q, scale = quantize_int4_groups(weight.detach().reshape(-1, weight.shape[-1]), self.group)
        rounded = (q.float().unflatten(-1, (-1, self.group)) * scale.float().unsqueeze(-1)).reshape(weight.shape)
        return weight + (rounded - weight).detach()


def fake_quantize_experts(model: torch.nn.Module, group: int) -> list[torch.nn.Module]:
    """Parametrize every routed-expert weight with FakeInt4; returns the modules (for unfake_experts)."""
    from torch.nn.utils import parametrize

    modules = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for experts in modules:
        for name in ("gate_up_proj", "down_proj"):
            parametrize.register_parametrization(experts, name, FakeInt4(group))
    return modules


def unfake_experts(modules: list[torch.nn.Module]) -> None:
    from torch.nn.utils import parametrize

    for experts in modules:
        for name in ("gate_up_proj", "down_proj"):
            parametrize.remove_parametrizations(experts, name, leave_parametrized=False)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: there bf16 matmuls run about twice fp32's speed; without them about 3x slower."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class AttentionLogitClip:
    """K2's QK-Clip (the "Clip" of MuonClip) for MLA, bounding each head's largest attention logit.

    Forward pre-hooks keep each attention layer's input from the last step; after the optimizer step,
    each head's largest causal logit on the first row is bounded (rope part by |q_pe||k_pe|, an upper
    bound) and, where it exceeds `tau`, the head's query (nope and rope rows of q_b_proj) and its own key
    rows of kv_b_proj are scaled down, as K2 does, so the logit is at most `tau`; the shared rope key is
    left alone. Without it this tiny model's attention saturated (every head one-hot, entropy ~0) and
    stopped learning to look back at the user's words.
    """

    def __init__(self, model: torch.nn.Module, tau: float) -> None:
        self.tau = tau
        self.layers = [layer.self_attn for layer in model.model.layers]
        self.inputs: dict[int, torch.Tensor] = {}
        self.clipped = 0
        for i, attn in enumerate(self.layers):
            attn.register_forward_pre_hook(self._keep(i), with_kwargs=True)

    def _keep(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.inputs[index] = hidden[:1].detach()
        return hook

    @torch.no_grad()
    def __call__(self) -> None:
        for i, attn in enumerate(self.layers):
            x = self.inputs.get(i)
            if x is None:
                continue
            heads, nope, rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))[0].view(-1, heads, nope + rope)
            kv = attn.kv_a_proj_with_mqa(x)[0]
            latent, k_pe = kv[:, : attn.kv_lora_rank], kv[:, attn.kv_lora_rank:]
            k_nope = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(-1, heads, nope + attn.v_head_dim)[..., :nope]
            t = x.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            dots = torch.einsum("qhd,khd->hqk", q[..., :nope], k_nope)
            dots = dots + q[..., nope:].norm(dim=-1).T[:, :, None] * k_pe.norm(dim=-1)[None, None, :]
            peak = dots.masked_fill(~causal, float("-inf")).amax(dim=(1, 2)) * attn.scaling
            for h in (peak > self.tau).nonzero().flatten().tolist():
                gamma = self.tau / peak[h].item()
                qb = attn.q_b_proj.weight.view(heads, nope + rope, -1)
                qb[h, :nope] *= gamma ** 0.5
                qb[h, nope:] *= gamma
                attn.kv_b_proj.weight.view(heads, nope + attn.v_head_dim, -1)[h, :nope] *= gamma ** 0.5
                self.clipped += 1


def write_weights(model: torch.nn.Module, cfg: dict[str, Any], out: Path, prefix: str = "language_model.") -> None:
    """Overwrite the text model's tensors in `out`'s shards with the model's weights (the vision tower's stay)."""
    from safetensors.torch import load_file, save_file

    tensors = {prefix + n: t for n, t in export_checkpoint_tensors(model, cfg).items()}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for f in sorted(set(index["weight_map"].values())):
        shard = load_file(str(out / f))
        shard.update({n: t for n, t in tensors.items() if index["weight_map"].get(n) == f})
        save_file({n: t.contiguous() for n, t in shard.items()}, str(out / f), metadata={"format": "pt"})
        (out / f).chmod(0o644)  # safetensors writes through a private temp file


def train(args: argparse.Namespace) -> Path:
    import transformers
    from torch.nn.utils import parametrize
    from tqdm import tqdm
    from transformers import DeepseekV3ForCausalLM

    from kserve.chat import load_tokenizer
    from kserve.model.hf_reference import hf_config
    from kserve.tiny import write_tiny_checkpoint

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    convos = generate(args.seed, args.conversations, "train", **data_options(args))
    ranks = learn_corpus_ranks(convos[: args.bpe_conversations], args.vocab)
    # make-tiny writes the tokenizer files, config and vision tower; the text weights are then replaced
    write_tiny_checkpoint(out, seed=args.seed, variant="k25", config_overrides=TEXT_OVERRIDES, ranks=ranks)
    wrapper = json.loads((out / "config.json").read_text())
    cfg = {**wrapper["text_config"], "eos_token_id": wrapper["eos_token_id"]}
    tokenizer = load_tokenizer(out)
    pad_id = cfg["eos_token_id"]

    examples = [encode_conversation(tokenizer, c["text"], c["spans"], args.arguments_weight, args.choice_weight) for c in convos]
    planted = examples
    if args.repeat_break_share:
        think = [tokenizer.encode(t, allow_special_tokens=True)[0] for t in (THINK_BEGIN, THINK_END)]
        loops = random.Random(args.seed)
        planted = [break_a_repeat(*e, *think, loops) if loops.random() < args.repeat_break_share else e
                   for e in examples]
    batches = length_batches(planted, args.max_len, args.batch_tokens, pad_id)
    n_tokens = sum(len(e[0]) for e in planted)
    print(f"{len(convos)} conversations, {n_tokens} tokens ({n_tokens / len(convos):.0f} each, vocabulary "
          f"{len(ranks)}), {sum(sum(w > 0 for w in e[1]) for e in planted)} trained; {len(batches)} batches")

    if args.init_from:  # continue from an earlier run's checkpoint (same data, so the same tokenizer)
        from kserve.model.hf_reference import build_hf_reference

        if (Path(args.init_from) / "tiktoken.model").read_bytes() != (out / "tiktoken.model").read_bytes():
            raise SystemExit(f"{args.init_from} has another tokenizer: train it with the same data arguments")
        model = build_hf_reference(args.init_from).float().train()
    else:
        model = DeepseekV3ForCausalLM(hf_config(out)).float().train()
        if args.tied_init:  # the checkpoint stays untied; only the starting point is shared
            model.lm_head.weight.data.copy_(model.model.embed_tokens.weight.data)
        if args.induction_init:
            from induction_init import plant_induction_circuit

            plant_induction_circuit(model, seed=args.seed, token_bytes=ranks)
    faked = fake_quantize_experts(model, INT4_GROUP) if args.int4_qat else []
    bf16 = args.matmul_dtype == "bf16" or args.matmul_dtype == "auto" and cpu_has_native_bf16()
    print(f"matmuls in {'bf16' if bf16 else 'fp32'}")
    clip = AttentionLogitClip(model, args.qk_clip) if args.qk_clip else None
    start = last_export = time.time()

    def run_stage(name: str, stage_batches: list, steps: int, peak_lr: float, warmup: int,
                  stop_at: int | None) -> list[dict[str, float]]:
        nonlocal last_export
        opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.01)
        gen = torch.Generator().manual_seed(args.seed if args.shuffle_seed is None else args.shuffle_seed)
        order: list[int] = []
        log: list[dict[str, float]] = []
        bar = tqdm(range(steps), desc=name, unit="step")
        for step in bar:
            if args.time_limit and time.time() - start > args.time_limit or step == stop_at:
                print(f"stopped at step {step}")
                break
            if not order:  # a new epoch: every batch once, in a seeded order
                order = torch.randperm(len(stage_batches), generator=gen).tolist()
            x, m, real = stage_batches[order.pop()]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, peak_lr, warmup)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), parametrize.cached():
                logits = model(input_ids=x).logits[:, :-1]
            target, weight = x[:, 1:].reshape(-1), m[:, 1:].reshape(-1)
            assistant = (weight > 0).float()
            context = real[:, 1:].reshape(-1).float() - assistant - (weight == IGNORED).float()
            weight = weight.clamp(min=0)
            flat_logits = logits.float().reshape(-1, logits.shape[-1])
            loss_tok = torch.nn.functional.cross_entropy(flat_logits, target, reduction="none")
            n_assistant = assistant.sum().clamp(min=1)
            loss = (loss_tok * assistant).sum() / n_assistant  # what the curve shows
            total = (loss_tok * weight).sum() / n_assistant
            # the rest of the conversation is learned too, at a lower weight: predicting the user's words and the
            # repeated tool names teaches the attention to look back and copy, which the assistant turns need
            total = total + args.context_weight * (loss_tok * context).sum() / context.sum().clamp(min=1)
            if args.unlikelihood_weight:
                total = total + args.unlikelihood_weight * unlikelihood(flat_logits, x, assistant > 0) / n_assistant
            opt.zero_grad(set_to_none=True)
            with parametrize.cached():
                total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if clip is not None:
                clip()
            log.append({"step": step, "loss": loss.item(), "seconds": time.time() - start})
            bar.set_postfix(loss=f"{log[-1]['loss']:.3f}", clipped=clip.clipped if clip else 0)
            if args.export_every and time.time() - last_export > args.export_every:
                write_weights(model, cfg, out)
                last_export = time.time()
        return log

    logs = {"train": run_stage("train", batches, args.steps, args.lr, args.warmup, args.stop_at)}
    if args.polish_steps and len(logs["train"]) == args.steps:
        # the planted loops cost tool choice; a second stage without them, fresh optimizer and a lower peak, won
        # most of it back in the third run (docs/embedded_model.md)
        plain = batches if planted is examples else length_batches(examples, args.max_len, args.batch_tokens, pad_id)
        logs["polish"] = run_stage("polish", plain, args.polish_steps, args.polish_lr, args.polish_warmup, None)

    unfake_experts(faked)
    write_weights(model, cfg, out)
    # a run started from another keeps that one's stages before its own
    stages = _stages(Path(args.init_from)) if args.init_from else []
    # the same arguments give the same weights only under the same libraries: their initialization and
    # arithmetic differ between versions (docs/embedded_model.md)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    stages += [{"args": vars(args), "versions": versions, "stage": name, "log": log} for name, log in logs.items()]
    (out / "train_log.json").write_text(json.dumps({"stages": stages}, indent=1))
    curve, offset = [], 0
    for stage in stages:
        curve += [dict(row, step=row["step"] + offset) for row in stage["log"]]
        offset += len(stage["log"])
    _plot(curve, out / "loss.png")
    return out


def _stages(checkpoint: Path) -> list[dict[str, Any]]:
    path = checkpoint / "train_log.json"
    return json.loads(path.read_text())["stages"] if path.exists() else []


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


# The training data's shares: (flag, the recipe's value, what it is)
TRAINING_DATA_SHARES = (
    ("--echo-share", 0.0, "share of conversations asking to repeat random words, a copying probe"),
    ("--noise-share", 0.15, "chance that each literal part of a training request gets noise words"),
    ("--tail-share", 0.0, "chance that a one-task training request ends in a joiner word"),
    ("--link-share", 0.25, "chance that a two-task training request's tasks are joined by noise words alone"),
    ("--link-tail-share", 0.0, "chance that a one-task training request's task is followed by noise words alone"),
    ("--weather-share", 0.01, "share of the conversations asking for get_weather as \"What is the weather like in "
                             "{city} today?\" and its kin"),
    ("--thanks-closer-share", 0.1, "chance that a training request ends in a plain chat that thanks, "
                                   "\"Appreciate it.\""),
    ("--plain-share", 0.35, "share of the conversations that are plain chats, the rest tool requests"),
    ("--thinking-share", 0.6, "share of the conversations that think; the rest are trained with thinking off"),
    ("--made-up-city-share", 0.0, "chance that a training request's city is a made-up name, \"Doraven\", not one of "
                                  "the pool's 20"),
    ("--world-city-share", 0.0, "chance that a training request's city is a real city outside the pool and the "
                                "evaluation, \"Lisbon\""),
    ("--weather-world-city-share", 0.0, "chance that the city of a --weather-share question is a real city outside "
                                        "the pool and the evaluation, \"Lisbon\""),
    ("--history-share", 0.02, "share of conversations after a long history of earlier exchanges; give --max-len "
                             "3072 with it"),
)

# The training data's counts: (flag, the recipe's value, what it is)
TRAINING_DATA_COUNTS = (
    ("--question-chat-weight", 1, "how many times each entry of --question-chats is listed among the plain chats"),
)

# The training data's switches: (flag, the recipe's value, what it is)
TRAINING_DATA_FLAGS = (
    ("--link-inline", True, "link words only inside a sentence, never after a full stop"),
    ("--help-me-to", True, "the training wrapper \"Help me {intent}.\" becomes \"Help me to {intent}.\""),
    ("--question-chats", True, "plain chats include small talk asked as tool questions are, \"What's new?\""),
    ("--composed-chats", True, "plain chats include greetings, thanks and goodbyes composed from parts, "
                               "\"Hey pal, quick hello.\""),
    ("--weather-plain", True, "the weather questions include the plainest forms, \"What is the weather in {city}?\""),
    ("--unserved-requests", True, "plain chats include chores no tool does in the training wrappers, \"Please mow "
                                  "the lawn.\""),
    ("--chores-beside-weather", True, "get_weather is declared beside every chore of --unserved-requests"),
    ("--composed-closers", False, "the thanks closers include the composed thanks and goodbyes, \"Bye pal, off I "
                                  "go.\""),
)


def data_options(args: argparse.Namespace) -> dict[str, Any]:
    """`generate`'s keyword arguments from the training arguments, so the tokenizer test rebuilds the same data."""
    flags = [flag for flag, *_ in TRAINING_DATA_SHARES + TRAINING_DATA_COUNTS + TRAINING_DATA_FLAGS]
    return {name: getattr(args, name) for name in (flag[2:].replace("-", "_") for flag in flags)}


def parser() -> argparse.ArgumentParser:
    """The recipe's arguments; their defaults are the embedded model's."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=40000)
    p.add_argument("--steps", type=int, default=2600)
    p.add_argument("--batch-tokens", type=int, default=3072, help="padded tokens per batch")
    p.add_argument("--max-len", type=int, default=3072, help="longer conversations are cut")
    p.add_argument("--vocab", type=int, default=4096, help="BPE tokens learned from the conversations")
    p.add_argument("--bpe-conversations", type=int, default=3000)
    for flag, default, what in TRAINING_DATA_SHARES:
        p.add_argument(flag, type=float, default=default, help=f"{what} (docs/embedded_model.md)")
    for flag, default, what in TRAINING_DATA_COUNTS:
        p.add_argument(flag, type=int, default=default, help=f"{what} (docs/embedded_model.md)")
    for flag, default, what in TRAINING_DATA_FLAGS:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                       help=f"{what} (docs/embedded_model.md)")
    p.add_argument("--context-weight", type=float, default=0.3,
                   help="loss weight of the non-assistant tokens (the assistant's are 1)")
    p.add_argument("--arguments-weight", type=float, default=3.0,
                   help="loss weight of the tool calls' argument tokens (the rest of the assistant's are 1)")
    p.add_argument("--choice-weight", type=float, default=3.0,
                   help="loss weight of the tokens that choose text or a tool call, which tool, and how many calls")
    p.add_argument("--repeat-break-share", type=float, default=0.25,
                   help="share of conversations given an untrained loop in one reasoning sentence to leave")
    p.add_argument("--unlikelihood-weight", type=float, default=1.0,
                   help="weight of token-level unlikelihood on the tokens already in the sequence")
    p.add_argument("--matmul-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="bf16 autocast or fp32 matmuls (auto: bf16 where the CPU has native bf16)")
    p.add_argument("--qk-clip", type=float, default=15.0,
                   help="bound every head's attention logit by this (K2's QK-Clip; 0: off)")
    p.add_argument("--shuffle-seed", type=int, default=None, help="batch order (default: --seed)")
    p.add_argument("--init-from", default=None, help="start from this checkpoint's weights")
    p.add_argument("--export-every", type=float, default=0.0, help="also write the weights every this many seconds")
    p.add_argument("--tied-init", action="store_true",
                   help="a fresh run starts the output embedding equal to the input one (an experiment; it did not help: "
                        "docs/embedded_model.md)")
    p.add_argument("--induction-init", action=argparse.BooleanOptionalAction, default=True,
                   help="a fresh run starts with a planted induction circuit (scripts/induction_init.py), so it copies")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--polish-steps", type=int, default=600,
                   help="then this many steps without the planted loops, with a fresh optimizer (0: none)")
    p.add_argument("--polish-lr", type=float, default=5e-4)
    p.add_argument("--polish-warmup", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-int4-qat", dest="int4_qat", action="store_false",
                   help="train the routed experts in fp32 and only round them to INT4 at export")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this many steps (the learning-rate schedule still spans --steps)")
    p.add_argument("--time-limit", type=float, default=0.0, help="stop after this many seconds (0: none)")
    return p


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of returning it to the system. Each step frees and
    allocates tensors of tens of MB (the logits, their gradients); by default glibc unmaps those and maps
    them afresh next step, and the page faults cost about a tenth of the step (docs/embedded_model.md,
    `benchmarks/bench_train_step.py`). The arithmetic is unchanged. False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mmap_threshold, trim_threshold = -3, -1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD in <malloc.h>
    return bool(libc.mallopt(mmap_threshold, 1 << 30) and libc.mallopt(trim_threshold, (1 << 31) - 1))


def bound_onednn_caches(entries: int = 64) -> None:
    """bf16 matmuls on the CPU go through oneDNN, and two caches (ideep's and oneDNN's own, 1,024 entries each by
    default) keep a compiled primitive for every shape seen. Batches come in hundreds of shapes, so the caches
    held about 6 GiB (9.7 GiB peak against 3.5 in fp32); a step reuses far fewer. Read at first use, so this
    must run before the first matmul. A variable already set is left alone."""
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(entries))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    keep_freed_memory()  # here, not in train(): a process that only trains keeps its memory until it exits
    bound_onednn_caches()
    print(train(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
