"""`kserve` command line: serve, make-tiny, render, plan."""

from __future__ import annotations

import argparse
import sys


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API")
    p.add_argument("model_dir", nargs="?", default=None, help="model directory (default: the embedded tiny model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--api-key", default=None, help="require this bearer token (or set KSERVE_API_KEY)")
    p.add_argument("--chat-template", default=None, help="a jinja chat template file to use instead of the model's")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1,
                   help="shard the KV cache by token over this many tensor-parallel ranks (divides --tp): "
                        "that many times the cache per node")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's total memory for weights, activations and the KV cache")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="auto = the model dtype; fp8 = an e4m3 latent cache with a scale (half the bytes)")
    p.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON (vLLM\'s keys): {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4} or {"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": 3}')
    p.add_argument("--language-model-only", action="store_true",
                   help="skip a K2.5/K2.6 checkpoint's vision tower (saves its memory; image requests get a 400)")
    p.add_argument("--allowed-media-domains", nargs="*", default=None, metavar="DOMAIN",
                   help="domains whose http(s) image URLs the server may fetch (default: none; data: URLs always work)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's logits (so its greedy tokens) do not depend on what it is batched with (slower)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--guided-decoding", choices=["on", "off"], default="on",
                   help="grammar-masked decoding for response_format, tool_choice and strict tools")
    p.add_argument("--tool-grammar", choices=["on", "off"], default="on",
                   help="constrain tool-call sections under tool_choice=auto")
    p.add_argument("--skip-self-check", action="store_true")
    p.add_argument("--enable-reasoning", action="store_true",
                   help="split a leading <think>...</think> into reasoning_content for templates that do not prefill "
                        "<think> (K2.5+ templates that do are parsed without it)")
    p.add_argument("--legacy-prompt-encoding", action="store_true",
                   help="encode the whole rendered prompt with special tokens allowed (unsafe)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every chat completions stream with usage, as stream_options.include_usage asks "
                        "(vLLM's flag)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--max-request-bytes", type=int, default=32 * 1024 * 1024,
                   help="reject request bodies larger than this with 413")
    p.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="answer 429 beyond this many requests in flight (default: no limit)")
    p.add_argument("--exit-on-engine-death", action=argparse.BooleanOptionalAction, default=True,
                   help="exit non-zero once the engine is dead (fatal error, or repeated failed steps), so a "
                        "supervisor restarts it; with --no-exit-on-engine-death it stays up answering 503")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds that requests in flight may take to finish before they are cut")
    p.add_argument("--keep-alive-timeout", type=float, default=75.0,
                   help="seconds an idle HTTP connection stays open; above the clients' own pool expiry (httpx: 5), "
                        "so a client never reuses a connection the server is closing")
    p.add_argument("--responses-store-size", type=int, default=1000,
                   help="finished /v1/responses kept in memory for previous_response_id and GET (0: off)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the --tp ranks span (tp / nnodes ranks each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 holds rank 0 and serves HTTP")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, where every rank rendezvouses")
    p.add_argument("--master-port", type=int, default=None, help="node 0's rendezvous port (needed with --nnodes > 1)")
    p.add_argument("--headless", action="store_true",
                   help="nodes other than 0: run this node's ranks without the HTTP server")
    p.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds before a blocked collective or the rendezvous fails")


def _add_make_tiny(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny", help="write a tiny random checkpoint in Kimi K2's published layout")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variant", choices=["k2", "v3", "k25"], default="k2",
                   help="k2: K2-Instruct (block FP8); v3: DeepSeek-V3 routing; k25: K2.6 (kimi_k25 wrapper, INT4 experts)")
    p.add_argument("--eagle3-draft-for", metavar="TARGET_DIR", default=None,
                   help="write a tiny random EAGLE-3 draft (LlamaForCausalLMEagle3 layout) for this target instead")
    p.add_argument("--geometry", choices=["k2", "small"], default="k2",
                   help="attention widths: K2's (qk_nope 128, rope 64, v 128, kv_lora 512) or the older small ones")


def _add_render(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="print the exact prompt for an OpenAI chat request read from stdin")
    p.add_argument("model_dir", nargs="?", default=None)
    p.add_argument("--ids", action="store_true", help="also print the prompt token ids")
    p.add_argument("--jsonl", action="store_true",
                   help="one request per stdin line; one JSON object per line: {prompt} (+ ids), or {error}")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--legacy-prompt-encoding", action="store_true")


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-rank weight bytes, KV cache size and whether a model fits (no GPU needed)")
    p.add_argument("model", help="a model directory or a config.json file")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", dest="dcp", type=int, default=1,
                   help="KV cache sharded by token over this many tensor-parallel ranks")
    p.add_argument("--gpu-memory-gib", type=float, default=None,
                   help="memory per GPU in GiB (default: this machine's GPU 0)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _run_plan(args: argparse.Namespace) -> int:
    from kserve.model.memory_plan import GIB, load_plan_config, plan_memory

    if args.gpu_memory_gib is not None:
        total = int(args.gpu_memory_gib * GIB)
    else:
        import torch

        if not torch.cuda.is_available():
            print("kserve plan: no GPU here; give --gpu-memory-gib", file=sys.stderr)
            return 2
        total = torch.cuda.get_device_properties(0).total_memory
    try:
        config = load_plan_config(args.model)
        plan = plan_memory(
            config, args.tp, total, model_name=str(args.model), max_model_len=args.max_model_len,
            kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            decode_context_parallel_size=args.dcp,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"kserve plan: {exc}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else plan.format_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kserve", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    _add_serve(sub)
    _add_make_tiny(sub)
    _add_render(sub)
    _add_plan(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "serve":
        from kserve.server.launch import run_server

        return run_server(args) or 0
    if args.command == "make-tiny" and args.eagle3_draft_for:
        from kserve.tiny.eagle3_draft import write_tiny_eagle3_draft

        print(write_tiny_eagle3_draft(args.dir, args.eagle3_draft_for, seed=args.seed))
        return 0
    if args.command == "make-tiny":
        from kserve.tiny import write_tiny_checkpoint

        path = write_tiny_checkpoint(args.dir, seed=args.seed, variant=args.variant, geometry=args.geometry)
        print(path)
        return 0
    if args.command == "plan":
        return _run_plan(args)
    if args.command == "render":
        from kserve.chat.render_cli import run_render

        if args.model_dir is None:
            from kserve.tiny import embedded_model_dir

            args.model_dir = str(embedded_model_dir())

        return run_render(args, stdin=sys.stdin, stdout=sys.stdout)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
