"""`kserve serve`: settings from the command line, uvicorn in the foreground or in a background thread."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from kserve.config import EngineConfig
from kserve.engine.speculative import SpeculativeConfig
from kserve.server.app import (
    EngineDeathHandler,
    EngineLoader,
    LoadFailureHandler,
    build_app,
)
from kserve.server.context import DEFAULT_MAX_REQUEST_BYTES, ServerSettings
from kserve.server.request_log import install_request_id_logging

logger = logging.getLogger("kserve.server")
ENGINE_DEATH_EXIT_S = 25.0  # after a tensor-parallel rank is lost, the process is gone within this long
# Once the engine is dead, `kserve serve` answers 503 this long before it exits, so health probes and load
# balancers see the 503 rather than only a refused connection.
ENGINE_DEATH_503_S = 2.0


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    engine = EngineConfig(
        model=args.model_dir,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        decode_context_parallel_size=getattr(args, "decode_context_parallel_size", 1),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        enforce_eager=getattr(args, "enforce_eager", False),
        batch_invariant=getattr(args, "batch_invariant", False),
        language_model_only=getattr(args, "language_model_only", False),
        # parsed here so that a bad value fails at start with its message
        speculative_config=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
    )
    return ServerSettings(
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("KSERVE_API_KEY") or None,
        chat_template=args.chat_template,
        max_request_bytes=getattr(args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES),
        max_concurrent_requests=getattr(args, "max_concurrent_requests", None),
        guided_decoding=args.guided_decoding == "on",
        tool_grammar=args.tool_grammar == "on",
        skip_self_check=args.skip_self_check,
        enable_reasoning=args.enable_reasoning,
        legacy_prompt_encoding=args.legacy_prompt_encoding,
        force_include_usage=getattr(args, "enable_force_include_usage", False),
        log_level=args.log_level,
        exit_on_engine_death=getattr(args, "exit_on_engine_death", True),
        responses_store_size=getattr(args, "responses_store_size", 1000),
        drain_timeout_s=getattr(args, "drain_timeout", 30.0),
        keep_alive_timeout_s=getattr(args, "keep_alive_timeout", 75.0),
        allowed_media_domains=getattr(args, "allowed_media_domains", None),
    )


def _configure_logging(level: str) -> None:
    install_request_id_logging(level)


def _uvicorn_config(settings: ServerSettings, loader: EngineLoader | None,
                    on_load_failure: LoadFailureHandler | None = None,
                    on_engine_death: EngineDeathHandler | None = None) -> uvicorn.Config:
    return uvicorn.Config(build_app(settings, loader, on_load_failure, on_engine_death), host=settings.host,
                          port=settings.port, log_level=settings.log_level.lower(),
                          timeout_graceful_shutdown=settings.drain_timeout_s,
                          timeout_keep_alive=settings.keep_alive_timeout_s,
                          access_log=settings.log_level.lower() == "debug", log_config=None)


def run_server(args: argparse.Namespace) -> int:
    from kserve.engine.rank_launch import RANK_LAYOUT_KEY, layout_for_serve

    try:
        layout = layout_for_serve(
            args.tensor_parallel_size, getattr(args, "nnodes", 1), getattr(args, "node_rank", 0),
            getattr(args, "master_addr", "127.0.0.1"), getattr(args, "master_port", None),
            getattr(args, "headless", False), getattr(args, "dist_timeout", 300.0),
            # a lost rank can leave a collective blocked: the server exits even then (after the 503s)
            ENGINE_DEATH_EXIT_S if getattr(args, "exit_on_engine_death", True) else None,
        )
    except ValueError as exc:
        _configure_logging(args.log_level)
        logger.error("%s", exc)
        return 2
    if layout is not None and layout.this_rank != 0:
        _configure_logging(args.log_level)
        local = layout.spawned_ranks or [layout.this_rank]
        logger.info("kserve headless node %d: ranks %d..%d of %d, rank 0 at %s:%s", layout.node_rank,
                    layout.this_rank, local[-1], layout.world_size, layout.master_addr, layout.master_port)
        from kserve.engine.tp_workers import run_headless

        return run_headless(layout, args.model_dir, args.device, args.dtype)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:  # an impossible engine configuration: say so, no traceback
        _configure_logging(args.log_level)
        logger.error("%s", exc)
        return 2
    if layout is not None:
        settings.engine.extra[RANK_LAYOUT_KEY] = layout
    return serve(settings)


def serve(settings: ServerSettings) -> int:
    """`kserve serve` with these settings, in the foreground; the process's exit status."""
    _configure_logging(settings.log_level)
    for label, path in (("model directory", settings.engine.model), ("--chat-template", settings.chat_template)):
        if path is not None and not Path(path).exists():
            logger.error("%s %s does not exist", label, path)
            return 2
    logger.info("kserve listening on http://%s:%d (model %s loads in the background; /health turns 200 "
                "when ready)", settings.host, settings.port, settings.engine.model or "<embedded tiny>")
    failures: list[str] = []

    def stop_on_load_failure(message: str) -> None:
        # A server that can never serve should not sit behind 503s: exit non-zero so a supervisor notices.
        failures.append(message)
        server.should_exit = True

    def stop_on_engine_death(message: str) -> None:
        # In-flight requests already got their 503; the graceful shutdown lets those streams close.
        failures.append(f"the engine is dead: {message}")
        asyncio.get_running_loop().call_later(ENGINE_DEATH_503_S, setattr, server, "should_exit", True)

    on_death = stop_on_engine_death if settings.exit_on_engine_death else None
    server = uvicorn.Server(_uvicorn_config(settings, None, stop_on_load_failure, on_death))
    server.run()
    if failures:
        logger.error("kserve serve is stopping: %s", failures[0])
        return 1
    return 0 if server.started else 1


class BackgroundServer:
    """A real uvicorn server on 127.0.0.1 in a daemon thread (tests, benchmarks).

    The listening socket is bound before the thread starts, so the port is known and free of races.
    """

    def __init__(self, settings: ServerSettings, loader: EngineLoader | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((settings.host, settings.port))
        settings.port = self.sock.getsockname()[1]
        self.settings = settings
        self.server = uvicorn.Server(_uvicorn_config(settings, loader))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self._run, name="kserve-uvicorn", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    @property
    def app(self) -> Any:
        return self.server.config.app

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        finally:
            self.loop.close()

    def call_in_loop(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` on the server's event loop (thread-safe)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def start(self, ready_timeout: float = 300.0) -> BackgroundServer:
        """Start and wait until /health says the model is loaded (raises if loading failed)."""
        self.thread.start()
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            state = getattr(self.app.state, "server", None)
            if self.server.started and state is not None:
                if state.context is not None:
                    return self
                if state.load_error is not None:
                    self.stop()
                    raise RuntimeError(f"model failed to load: {state.load_error}")
            if not self.thread.is_alive():
                raise RuntimeError("server thread exited during startup")
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"server not ready after {ready_timeout}s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
