"""Where a decode step's time goes, stage by stage, on bench_peer's 4-layer checkpoint (K2 head widths).

Each stage's time is exclusive (a stage inside another is not counted twice), summed over decode-only steps
of one batch and divided by their number. The stages are the engine's own functions, timed by wrapping them:
scheduler (schedule, finish_step, remove_finished), batch build (runner.prepare), per layer the attention
projections and cache write, the absorbed W_UK / W_UV bmms, the MLA decode kernel, the fused MoE (routed experts),
the router and the dense MLPs (layer 0, shared experts), the LM head, the sampler, and the detokenizer/output.

    python benchmarks/profile_step.py [--dtype bfloat16] [--batches 1,64] [--threads 1] [--steps 32]
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

    def wrap(self, owner: object, name: str, label: str) -> None:
        inner: Callable = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            clock._stack.append([label, time.perf_counter(), 0.0])
            try:
                return inner(*args, **kwargs)
            finally:
                label_, start, children = clock._stack.pop()
                spent = time.perf_counter() - start
                clock.totals[label_] += spent - children
                if clock._stack:
                    clock._stack[-1][2] += spent

        setattr(owner, name, timed)


def instrument(engine, clock: StageClock) -> None:
    import kserve.model.deepseek_v3 as model_mod
    from kserve.layers import embedding, mlp, moe

    clock.wrap(engine, "step", "engine (rest of step)")
    for name in ("schedule", "finish_step", "remove_finished"):
        clock.wrap(engine.scheduler, name, "scheduler")
    clock.wrap(engine.runner, "prepare", "batch build")
    clock.wrap(engine.runner, "execute", "model (rest: embedding, norms, residuals)")
    clock.wrap(engine, "_sample", "sampler")
    clock.wrap(engine.output_processor, "append_token", "detokenizer and output")
    clock.wrap(model_mod.MLAttention, "forward", "attention: projections, rope, cache write")
    clock.wrap(model_mod.MLAttention, "_absorbed", "attention: absorbed W_UK / W_UV bmms")
    clock.wrap(model_mod, "mla_decode", "attention: MLA decode")
    clock.wrap(moe.RoutedExperts, "forward", "MoE: fused routed experts")
    clock.wrap(moe.NoAuxRouter, "forward", "MoE: router")
    clock.wrap(mlp.GatedMLP, "forward", "dense MLP (layer 0, shared experts)")
    clock.wrap(embedding.LMHead, "forward", "LM head")


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
    instrument(engine, clock)
    for _ in range(steps):
        engine.step()
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
            for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
                ms = seconds / steps * 1000
                print(f"  {label:<46} {ms:8.3f} ms {ms / step_ms:6.1%}")
            print()


if __name__ == "__main__":
    main()
