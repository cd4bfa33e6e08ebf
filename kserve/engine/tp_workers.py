"""Tensor parallelism for the engine: ranks 1..N-1 mirror rank 0's forward, on this node or others.

Rank 0 schedules, samples and owns the outputs; it sends every step before running it, so all ranks enter the same
collectives in the same order. The other ranks run `ModelRunner.execute` and drop the logits. A lost rank makes
every later step raise `RankLostError`. Details: docs/multinode.md, 'Rank 0 and the workers'.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kserve.distributed import ContextParallelGroup, ParallelState, context_parallel_groups
from kserve.engine.errors import FatalEngineError
from kserve.engine.model_runner import ModelRunner, StepInputs
from kserve.engine.rank_launch import RankLayout
from kserve.engine.step_broadcast import MessageKind, StepChannel

logger = logging.getLogger(__name__)

_READY_KEY = "kserve/ready/{rank}"
_ERROR_KEY = "kserve/error/{rank}"
_CLEANUP_TIMEOUT_S = 5.0


class RankLostError(FatalEngineError):
    """A tensor-parallel rank died, failed, or stopped answering: no step can run any more."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(device: torch.device, index: int) -> torch.device:
    return torch.device("cuda", index) if device.type == "cuda" else device


def _connect(layout: RankLayout, rank: int, device: torch.device) -> tuple[Any, Any]:
    """Join the world group (rank 0 hosts the TCP store) and create the gloo control group;
    returns (store, control group)."""
    assert layout.master_port is not None
    timeout = datetime.timedelta(seconds=layout.collective_timeout_s)
    store = dist.TCPStore(
        layout.master_addr, layout.master_port, layout.world_size,
        is_master=rank == 0 and not layout.use_agent_store, timeout=timeout, wait_for_workers=False,
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=layout.world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=layout.control_timeout_s))
    return store, control


def _bounded(fn: Any, timeout: float, what: str) -> None:
    """Run `fn` in a daemon thread and wait at most `timeout` seconds (cleanup must never hang)."""
    thread = threading.Thread(target=fn, name=f"kserve-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning("%s did not finish within %.0fs; going on without it", what, timeout)


def _destroy_groups() -> None:
    def destroy() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    _bounded(destroy, _CLEANUP_TIMEOUT_S, "destroy-process-group")


# ---------------------------------------------------------------------------------------- worker ranks
def run_worker_rank(layout: RankLayout, rank: int, model_dir: str, device: str, dtype: torch.dtype) -> int:
    """One worker rank, in this process, until rank 0 says SHUTDOWN (0) or anything fails (1)."""
    from kserve.model import load_model

    dev = _rank_device(torch.device(device), layout.local_index(rank))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = None
    try:
        store, control = _connect(layout, rank, dev)
        channel = StepChannel(control)
        parallel = ParallelState(tp_rank=rank, tp_size=layout.world_size, group=dist.group.WORLD)
        model = load_model(model_dir, device=dev, dtype=dtype, parallel=parallel)
        channel.embed_width = model.config.hidden_size
        runner: ModelRunner | None = None
        while True:
            message = channel.receive()
            if message.kind == MessageKind.STEP:
                if runner is None:
                    raise RuntimeError("rank 0 sent a step before the cache was set up")
                runner.execute(message.step)
            elif message.kind == MessageKind.HEARTBEAT:
                continue
            elif message.kind == MessageKind.INIT:
                num_blocks, block_size, options, dcp_size = message.init
                context_parallel = context_parallel_groups(rank, layout.world_size, dcp_size)  # collective
                runner = ModelRunner(model, model.config, num_blocks, block_size, dev, dtype,
                                     context_parallel=context_parallel, **options)
                store.set(_READY_KEY.format(rank=rank), "ok")
            else:  # SHUTDOWN
                logger.info("tensor-parallel rank %d: rank 0 shut the engine down; exiting", rank)
                _destroy_groups()
                return 0
    except BaseException as exc:  # noqa: BLE001 -- reported to rank 0 where possible, then exit non-zero
        logger.error("tensor-parallel rank %d stops: %s: %s", rank, type(exc).__name__, exc)
        if store is not None:
            try:
                store.set(_ERROR_KEY.format(rank=rank), f"{type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 -- rank 0 may be the one that is gone
                logger.debug("could not report rank %d's failure to rank 0's store", rank)
        return 1


def _exit_when_parent_dies(parent_pid: int, interval_s: float = 0.5) -> None:
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(interval_s)

    threading.Thread(target=watch, name="kserve-parent-watch", daemon=True).start()


def _spawned_rank_main(layout: RankLayout, rank: int, model_dir: str, device: str, dtype: torch.dtype,
                       parent_pid: int) -> None:
    """Entry point of a rank this node's kserve process started."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    _exit_when_parent_dies(parent_pid)
    code = run_worker_rank(layout, rank, model_dir, device, dtype)
    os._exit(code)  # skip interpreter teardown: nothing of ours is left to flush, and it must not hang


class _LocalRanks:
    """This node's spawned ranks, and a thread that reports the first one that exits."""

    def __init__(self, layout: RankLayout, model_dir: str, device: torch.device, dtype: torch.dtype) -> None:
        ctx = mp.get_context("spawn")
        self.procs: dict[int, Any] = {}
        for rank in layout.spawned_ranks:
            proc = ctx.Process(
                target=_spawned_rank_main,
                args=(layout, rank, model_dir, str(device), dtype, os.getpid()),
                name=f"kserve-rank{rank}",
                daemon=True,
            )
            proc.start()
            self.procs[rank] = proc
        self.stopping = False

    def watch(self, on_exit: Any) -> None:
        """Call `on_exit(rank, exitcode)` from a daemon thread when a rank exits before `stop`."""
        if not self.procs:
            return

        def run() -> None:
            sentinels = {proc.sentinel: rank for rank, proc in self.procs.items()}
            while not self.stopping and sentinels:
                for ready in multiprocessing.connection.wait(list(sentinels), timeout=0.5):
                    rank = sentinels.pop(ready)
                    proc = self.procs[rank]
                    proc.join(0)
                    if not self.stopping:
                        on_exit(rank, proc.exitcode)

        threading.Thread(target=run, name="kserve-rank-monitor", daemon=True).start()

    def stop(self, timeout: float) -> None:
        self.stopping = True
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)


def run_headless(layout: RankLayout, model_dir: str | None, device: str, dtype: str) -> int:
    """`kserve serve --headless` (or a torchrun rank other than 0): this node's worker ranks until rank 0
    stops them; the exit status is non-zero if anything failed (rank 0 gone, a local rank lost)."""
    from kserve.engine.device import resolve_device, resolve_dtype

    resolved = resolve_device(device)
    if model_dir is None:
        from kserve.tiny import embedded_model_dir

        model_dir = str(embedded_model_dir())
    return run_headless_node(layout, model_dir, resolved, resolve_dtype(dtype, resolved))


def run_headless_node(layout: RankLayout, model_dir: str | Path, device: str | torch.device,
                      dtype: torch.dtype) -> int:
    """A node without the HTTP server: its ranks run worker loops until rank 0 shuts them down (0), or
    something fails (non-zero: a lost local rank, rank 0 gone)."""
    if layout.this_rank == 0:
        raise ValueError("rank 0 serves HTTP and cannot be headless: give --headless only to other nodes")
    local = _LocalRanks(layout, str(model_dir), torch.device(device), dtype)

    def lost(rank: int, code: int | None) -> None:
        if code == 0:  # a rank exits 0 only on rank 0's SHUTDOWN, which this process's rank got too
            return
        logger.error("local rank %d exited with code %s; this node stops", rank, code)
        local.stop(0)
        os._exit(1)

    local.watch(lost)
    code = run_worker_rank(layout, layout.this_rank, str(model_dir), str(device), dtype)
    local.stop(_CLEANUP_TIMEOUT_S if code == 0 else 0)
    return code


# ---------------------------------------------------------------------------------------- rank 0
class TensorParallelWorkers:
    """Rank 0's side: starts this node's other ranks, joins every rank's process group, and sends each
    step to all of them (the ModelRunner's `peers`).

    `layout` None = one node, `world` ranks, a free loopback port. Multi-node and torchrun layouts come
    from kserve/engine/rank_launch.py; this process must be rank 0.
    """

    def __init__(self, model_dir: str | Path, world: int, device: torch.device, dtype: torch.dtype,
                 layout: RankLayout | None = None) -> None:
        if layout is None:
            layout = RankLayout(world_size=world)
        if layout.world_size != world:
            raise ValueError(f"tensor_parallel_size {world} does not match the rank layout's {layout.world_size}")
        if layout.this_rank != 0:
            raise ValueError(f"the engine runs on rank 0, not rank {layout.this_rank}")
        if layout.master_port is None:
            layout = _with_port(layout, _free_port())
        if device.type == "cuda" and torch.cuda.device_count() < layout.ranks_per_node:
            raise ValueError(f"{layout.ranks_per_node} ranks on this node need as many GPUs, "
                             f"found {torch.cuda.device_count()}")
        self.world = world
        self.layout = layout
        self.failure: RankLostError | None = None
        self._lock = threading.Lock()  # one control message at a time (engine thread vs heartbeat)
        self._last_send = time.monotonic()
        self._stopped = threading.Event()
        self._local = _LocalRanks(layout, str(model_dir), device, dtype)
        self._local.watch(lambda rank, code: self._fail(f"tensor-parallel rank {rank} exited with code {code}"))
        try:
            self._store, control = _connect(layout, 0, _rank_device(device, layout.local_index(0)))
        except BaseException:
            self._local.stop(0)
            raise
        self._channel = StepChannel(control)
        self.parallel = ParallelState(tp_rank=0, tp_size=world, group=dist.group.WORLD)
        self.context_parallel: ContextParallelGroup | None = None  # rank 0's DCP group, set by init_cache
        threading.Thread(target=self._heartbeat, name="kserve-heartbeat", daemon=True).start()

    # ------------------------------------------------------------------ liveness
    def _fail(self, why: str, cause: BaseException | None = None) -> RankLostError:
        if self.failure is None and not self._stopped.is_set():
            error = RankLostError(why)
            error.__cause__ = cause
            self.failure = error
            logger.critical("tensor parallelism is broken: %s", why)
            if self.layout.exit_after_failure_s is not None:
                timer = threading.Timer(self.layout.exit_after_failure_s, _exit_now, args=(why,))
                timer.daemon = True
                timer.start()
        return self.failure or RankLostError(why)

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RankLostError(str(self.failure)) from self.failure

    def _heartbeat(self) -> None:
        interval = self.layout.heartbeat_interval_s
        while not self._stopped.wait(interval / 2):
            if self.failure is not None:
                return
            if time.monotonic() - self._last_send < interval or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._stopped.is_set():
                    self._channel.send_heartbeat()
                    self._last_send = time.monotonic()
            except Exception as exc:  # noqa: BLE001 -- a peer is gone
                self._fail(f"a heartbeat to the other ranks failed: {type(exc).__name__}: {exc}", exc)
                return
            finally:
                self._lock.release()

    def _send(self, what: str, fn: Any, *args: Any) -> None:
        self._raise_if_failed()
        with self._lock:
            try:
                fn(*args)
            except Exception as exc:
                raise self._fail(f"sending {what} to the other ranks failed: {type(exc).__name__}: {exc}",
                                 exc) from exc
            self._last_send = time.monotonic()

    # ------------------------------------------------------------------ the engine's calls
    def init_cache(self, num_blocks: int, block_size: int, runner_options: dict[str, Any] | None = None,
                   dcp_size: int = 1) -> None:
        """Each worker allocates its cache; `runner_options` are ModelRunner keyword arguments (kv dtype ...).
        Every rank then forms its decode-context-parallel group of `dcp_size` ranks (rank 0's lands in
        `self.context_parallel`). Returns once every rank is ready; raises RankLostError if one fails or
        the wait runs out."""
        self._send("the cache setup", self._channel.send_init,
                   (num_blocks, block_size, dict(runner_options or {}), dcp_size))
        self.context_parallel = context_parallel_groups(0, self.world, dcp_size)
        waiting = set(range(1, self.world))
        deadline = time.monotonic() + self.layout.ready_timeout_s
        while waiting:
            self._raise_if_failed()
            for rank in sorted(waiting):
                if self._store.check([_ERROR_KEY.format(rank=rank)]):
                    error = self._store.get(_ERROR_KEY.format(rank=rank)).decode(errors="replace")
                    raise self._fail(f"tensor-parallel rank {rank} failed to start: {error}")
                if self._store.check([_READY_KEY.format(rank=rank)]):
                    waiting.discard(rank)
            if time.monotonic() > deadline:
                raise self._fail(f"tensor-parallel ranks {sorted(waiting)} not ready after "
                                 f"{self.layout.ready_timeout_s:.0f}s")
            if waiting:
                time.sleep(0.05)

    def broadcast(self, inputs: StepInputs) -> None:
        self._send("a step", self._channel.send_step, inputs)

    def shutdown(self) -> None:
        """Tell every rank to stop, then clean up; bounded even when ranks are gone."""
        if self._stopped.is_set():
            return
        clean = self.failure is None
        self._local.stopping = True  # the ranks are about to exit: that is no failure
        if clean:
            def say_shutdown() -> None:
                with self._lock:
                    self._channel.send_shutdown()

            _bounded(say_shutdown, _CLEANUP_TIMEOUT_S, "shutdown-message")
        self._stopped.set()
        self._local.stop(30.0 if clean else 0.0)
        _destroy_groups()


def _with_port(layout: RankLayout, port: int) -> RankLayout:
    import dataclasses

    return dataclasses.replace(layout, master_port=port)


def _exit_now(why: str) -> None:
    logger.critical("exiting: a tensor-parallel rank was lost (%s) and the process did not stop by itself", why)
    os._exit(1)
