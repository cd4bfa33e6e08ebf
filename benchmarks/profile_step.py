"""Where a decode step's time goes, stage by stage, on bench_peer's 4-layer checkpoint (K2 head widths).

Each stage's time is exclusive (a stage inside another is not counted twice), summed over decode-only steps
of one batch and divided by their number. The stages are the engine's own functions, timed by wrapping them:
scheduler (schedule, finish_step, remove_finished), batch build (runner.prepare), per layer the attention
projections and cache write, the absorbed W_UK / W_UV bmms, the MLA decode kernel, the fused MoE (routed experts),
the router, the shared expert and the dense MLP (layer 0), then the LM head, the sampler, and the
detokenizer/output. Summed over layers unless `--per-layer`.

    python benchmarks/profile_step.py [--dtype bfloat16] [--batches 1,64] [--threads 1] [--steps 32] [--per-layer]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peer import write_peer_checkpoint


class StageClock:
    """Exclusive wall time per stage label; nested stages are subtracted from the enclosing one."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [label, start, child seconds]

    def wrap(self, owner: object, name: str, label: str | Callable[[str], str]) -> None:
        """Time `owner.name` (an instance's method or a module's function) as `label`, or as
        `label(enclosing label)` for a function shared by several stages."""
        inner: Callable = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            enclosing = clock._stack[-1][0] if clock._stack else ""
            clock._stack.append([label(enclosing) if callable(label) else label, time.perf_counter(), 0.0])
            try:
                return inner(*args, **kwargs)
            finally:
                label_, start, children = clock._stack.pop()
                spent = time.perf_counter() - start
                clock.totals[label_] += spent - children
                if clock._stack:
                    clock._stack[-1][2] += spent

        setattr(owner, name, timed)


ATTENTION = "attention: projections, rope, cache write"
ABSORBED = "attention: absorbed W_UK / W_UV bmms"


def instrument(engine, clock: StageClock) -> Callable[[], None]:
    """Wrap the engine's stages (per layer: `layer N: stage`); returns a function that unwraps them all."""
    import kserve.model.deepseek_v3 as model_mod

    wrapped: list[tuple[object, str, object]] = []

    def wrap(owner: object, name: str, label) -> None:
        wrapped.append((owner, name, owner.__dict__.get(name)))
        clock.wrap(owner, name, label)

    wrap(engine, "step", "engine (rest of step)")
    for name in ("schedule", "finish_step", "remove_finished"):
        wrap(engine.scheduler, name, "scheduler")
    wrap(engine.runner, "prepare", "batch build")
    wrap(engine.runner, "execute", "model (rest: embedding, norms, residuals)")
    wrap(engine, "_sample", "sampler")
    wrap(engine.output_processor, "append_token", "detokenizer and output")
    model = engine.runner.model
    for index, layer in enumerate(model.model.layers):
        prefix = f"layer {index}: "
        wrap(layer.self_attn, "forward", prefix + ATTENTION)
        wrap(layer.self_attn, "_absorbed", prefix + ABSORBED)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            wrap(mlp.experts, "forward", prefix + "MoE: fused routed experts (grouped)")
            wrap(mlp.gate, "forward", prefix + "MoE: router")
            if mlp.shared_experts is not None:
                wrap(mlp.shared_experts, "forward", prefix + "MoE: shared expert")
        else:
            wrap(mlp, "forward", prefix + "dense MLP")
    # the decode kernel is a module-level function: it belongs to the layer whose absorbed stage calls it
    wrap(model_mod, "mla_decode", lambda enclosing: enclosing.split(": ", 1)[0] + ": attention: MLA decode")
    wrap(model.lm_head, "forward", "LM head")

    def unwrap() -> None:
        for owner, name, original in reversed(wrapped):
            if original is None:
                delattr(owner, name)  # the class's method shows through again
            else:
                setattr(owner, name, original)

    return unwrap


def by_stage(totals: dict[str, float]) -> dict[str, float]:
    """Per-layer labels summed over the layers."""
    out: dict[str, float] = defaultdict(float)
    for label, seconds in totals.items():
        out[label.split(": ", 1)[1] if label.startswith("layer ") else label] += seconds
    return dict(out)


def profile_batch(model_dir: Path, dtype: str, batch: int, steps: int, prompt_len: int) -> tuple[dict, float]:
    """(exclusive seconds per stage over `steps` instrumented decode steps, seconds per uninstrumented step)."""
    from kserve.engine.llm import LLM
    from kserve.engine.sampling_params import SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, max_num_seqs=max(64, batch))
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 1700, (batch, prompt_len), generator=gen).tolist()
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    while any(s.num_computed_tokens < len(s.token_ids) - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain = (time.perf_counter() - start) / steps
    clock = StageClock()
    unwrap = instrument(engine, clock)
    for _ in range(steps):
        engine.step()
    unwrap()
    totals = dict(clock.totals)
    while engine.has_unfinished():
        engine.step()
    del llm, engine
    return totals, plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (bench_peer's vLLM comparison uses 1)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--per-layer", action="store_true", help="one row per layer and stage")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kserve-profile-") as tmp:
        model_dir = write_peer_checkpoint(Path(tmp), seed=0, layers=args.layers)
        for batch in (int(b) for b in args.batches.split(",")):
            totals, plain = profile_batch(model_dir, args.dtype, batch, args.steps, args.prompt_len)
            steps = args.steps
            step_ms = sum(totals.values()) / steps * 1000
            print(f"{args.dtype}, batch {batch}: {plain * 1000:.2f} ms per decode step uninstrumented, {step_ms:.2f} ms "
                  f"instrumented ({steps} steps each, {args.threads} threads, {args.layers} layers)")
            rows = totals if args.per_layer else by_stage(totals)
            for label, seconds in sorted(rows.items(), key=lambda kv: -kv[1]):
                ms = seconds / steps * 1000
                print(f"  {label:<56} {ms:8.3f} ms {ms / step_ms:6.1%}")
            print()


if __name__ == "__main__":
    main()
