"""Tensor parallelism for the engine: ranks 1..N-1 as worker processes that mirror rank 0's forward.

Rank 0 is the engine process: it schedules, samples and owns the outputs. Each worker loads its
shard of the model and its own KV cache, then loops: receive a step's `StepInputs` over a pipe, run
`ModelRunner.execute` (whose collectives pair with rank 0's), drop the logits. Rank 0 sends every
step before running it, so all ranks enter the same collectives in the same order.
Collectives use NCCL on CUDA and gloo on CPU (which is how the CPU tests run it).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kserve.distributed import ParallelState
from kserve.engine.model_runner import ModelRunner, StepInputs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _worker_main(
    rank: int, world: int, init_method: str, model_dir: str, device: str, dtype: torch.dtype,
    conn: multiprocessing.connection.Connection,
) -> None:
    from kserve.model import load_model

    dev = _rank_device(torch.device(device), rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        parallel = ParallelState(tp_rank=rank, tp_size=world, group=dist.group.WORLD)
        model = load_model(model_dir, device=dev, dtype=dtype, parallel=parallel)
        num_blocks, block_size, runner_options = conn.recv()
        runner = ModelRunner(model, model.config, num_blocks, block_size, dev, dtype, **runner_options)
        conn.send("ready")
        while True:
            inputs = conn.recv()
            if inputs is None:
                break
            runner.execute(inputs)
    finally:
        dist.destroy_process_group()


class TensorParallelWorkers:
    """Starts ranks 1..N-1 and joins rank 0 (this process) to their process group."""

    def __init__(self, model_dir: str | Path, world: int, device: torch.device, dtype: torch.dtype) -> None:
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs, found {torch.cuda.device_count()}")
        self.world = world
        if device.type == "cuda":
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        else:
            fd, path = tempfile.mkstemp(prefix="kserve-tp-")
            os.close(fd)
            os.unlink(path)
            init_method = f"file://{path}"
        ctx = mp.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[Any] = []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world, init_method, str(model_dir), str(device), dtype, child),
                daemon=True,
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=0, world_size=world
        )
        self.parallel = ParallelState(tp_rank=0, tp_size=world, group=dist.group.WORLD)

    def init_cache(self, num_blocks: int, block_size: int, runner_options: dict[str, Any] | None = None) -> None:
        """Each worker allocates its cache; `runner_options` are ModelRunner keyword arguments (kv dtype ...)."""
        for conn in self._conns:
            conn.send((num_blocks, block_size, dict(runner_options or {})))
        for conn in self._conns:
            if conn.recv() != "ready":
                raise RuntimeError("a tensor-parallel worker failed to start")

    def broadcast(self, inputs: StepInputs) -> None:
        for conn in self._conns:
            conn.send(inputs)

    def shutdown(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=30)
        self._conns, self._procs = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
