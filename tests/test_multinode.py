"""Tensor parallelism across nodes (simulated on 127.0.0.1) over the torch.distributed control plane.

Unit tests: the step wire format (pack/unpack), rank layouts from flags and from torchrun's environment.
Live tests run `kserve serve ... --nnodes 2` as two process trees, exactly as a user would on two nodes
(the head with HTTP, the other --headless), and check greedy tokens against a single process, live
requests, and that losing a rank or the head never leaves anything hanging.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist

from kserve.engine.model_runner import StepInputs
from kserve.engine.rank_launch import RankLayout, from_torchrun_env, layout_for_serve
from kserve.engine.step_broadcast import HEADER_LEN, MessageKind, pack_step, unpack_step

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is unavailable")

PROMPTS = [[11 + 3 * i + 7 * p for i in range(4 + 2 * p)] for p in range(8)]  # 8 prompts, 4..18 tokens
MAX_TOKENS = 4
READY_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 30.0


# ----------------------------------------------------------------------------------------- wire format
def _step(num_seqs: int, prefill: int, padded: int | None, seed: int) -> StepInputs:
    import random

    rng = random.Random(seed)
    query_lens = [1] * (num_seqs - 1) + [prefill]
    context_lens = [rng.randrange(q, 5000) for q in query_lens]
    tables = [[rng.randrange(0, 2**20) for _ in range(-(-c // 16))] for c in context_lens]
    num_tokens = sum(query_lens)
    return StepInputs(
        input_ids=[rng.randrange(0, 163840) for _ in range(num_tokens)],
        positions=[rng.randrange(0, 8192) for _ in range(num_tokens)],
        slots=[rng.randrange(0, 2**24) for _ in range(num_tokens)],
        block_tables=tables,
        query_lens=query_lens,
        context_lens=context_lens,
        sample_rows=sorted(rng.sample(range(num_tokens), k=min(3, num_tokens))),
        padded_batch_size=padded,
    )


@pytest.mark.parametrize("num_seqs,prefill,padded", [(1, 1, None), (5, 37, None), (16, 1, 16), (3, 1, 4)])
def test_step_round_trips_through_the_wire_format(num_seqs: int, prefill: int, padded: int | None) -> None:
    inputs = _step(num_seqs, prefill, padded, seed=num_seqs)
    header, payload = pack_step(inputs)
    assert header.shape == (HEADER_LEN,) and int(header[0]) == MessageKind.STEP
    assert payload.dtype.itemsize == 4 and payload.numel() == int(header[6])
    assert _as_lists(unpack_step(header, payload)) == inputs


def _as_lists(inputs: StepInputs) -> StepInputs:
    """Block tables arrive as int32 arrays; compare them as lists."""
    assert all(t.dtype.itemsize == 4 for t in inputs.block_tables)
    inputs.block_tables = [t.tolist() for t in inputs.block_tables]
    return inputs


def test_empty_tables_and_no_sample_rows_round_trip() -> None:
    inputs = StepInputs([5], [0], [3], [[]], [1], [1], [], None)
    assert _as_lists(unpack_step(*pack_step(inputs))) == inputs


def test_pack_refuses_values_outside_int32_and_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="int32"):
        pack_step(StepInputs([1], [0], [2**31], [[0]], [1], [1], [0]))
    with pytest.raises(ValueError, match="slots"):
        pack_step(StepInputs([1, 2], [0, 1], [0], [[0]], [2], [2], [1]))
    with pytest.raises(ValueError, match="block_tables"):
        pack_step(StepInputs([1], [0], [0], [[0], [1]], [1], [1], [0]))


# ----------------------------------------------------------------------------------------- layouts
def test_layout_numbers_ranks_node_by_node() -> None:
    layout = RankLayout(world_size=16, nnodes=2, node_rank=1, master_port=29500)
    assert layout.ranks_per_node == 8 and layout.first_rank == 8 and layout.this_rank == 8
    assert layout.spawned_ranks == list(range(9, 16))
    assert [layout.local_index(r) for r in (8, 9, 15)] == [0, 1, 7]


@pytest.mark.parametrize("kwargs,message", [
    ({"world_size": 6, "nnodes": 4, "master_port": 1}, "not divisible by --nnodes 4"),
    ({"world_size": 4, "nnodes": 2, "node_rank": 2, "master_port": 1}, "--node-rank must be in"),
    ({"world_size": 4, "nnodes": 2}, "--master-port"),
    ({"world_size": 2, "heartbeat_interval_s": 20.0}, "control_timeout_s"),
])
def test_bad_layouts_are_refused_with_the_flag_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RankLayout(**kwargs)


def test_serve_flags_and_headless_rules() -> None:
    assert layout_for_serve(1, env={}) is None
    assert layout_for_serve(2, env={}).ranks_per_node == 2
    with pytest.raises(ValueError, match="--headless"):
        layout_for_serve(4, 2, 1, "10.0.0.1", 29500, headless=False, env={})
    with pytest.raises(ValueError, match="node 0"):
        layout_for_serve(4, 2, 0, "10.0.0.1", 29500, headless=True, env={})
    layout = layout_for_serve(4, 2, 1, "10.0.0.1", 29500, headless=True, env={})
    assert (layout.first_rank, layout.master_addr, layout.master_port) == (2, "10.0.0.1", 29500)


def test_torchrun_environment_wins_over_flags() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    layout = from_torchrun_env(env)
    assert (layout.nnodes, layout.node_rank, layout.this_rank, layout.local_index(5)) == (2, 1, 5, 1)
    assert not layout.spawned_ranks and layout.use_agent_store
    assert layout_for_serve(8, env=env).this_rank == 5
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        layout_for_serve(4, env=env)


# ----------------------------------------------------------------------------------------- live nodes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    log: Path

    def tail(self) -> str:
        return f"--- {self.name} ---\n" + self.log.read_text(errors="replace")[-3000:]

    def group_alive(self) -> bool:
        """Whether any process of this node's tree (its own process group) is still running."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        # zombies of already-exited members still count to killpg; reap ours first
        return self.proc.poll() is None or _group_has_live_members(self.proc.pid)


def _group_has_live_members(pgid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@dataclass
class Cluster:
    """Two simulated nodes: `kserve serve --nnodes 2` head + --headless node, each its own process group."""

    tmp: Path
    model_dir: Path
    tp: int
    nnodes: int = 2
    torchrun: bool = False  # one `torchrun --standalone` launching tp processes instead of kserve's own spawning
    http_port: int = field(default_factory=_free_port)
    master_port: int = field(default_factory=_free_port)
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> Cluster:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for node_rank in range(self.nnodes):
            nodes = ["--nnodes", str(self.nnodes), "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
                     "--master-port", str(self.master_port)] if self.nnodes > 1 else []
            cmd = [sys.executable, "-m", "kserve.cli", "serve", str(self.model_dir), "--tp", str(self.tp), *nodes,
                   "--port", str(self.http_port), "--device", "cpu",
                   "--dtype", "float32", "--num-kv-blocks", "64", "--skip-self-check", "--dist-timeout", "60",
                   "--served-model-name", "x"]
            if node_rank:
                cmd.append("--headless")
            if self.torchrun:
                launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(self.tp), "-m"]
                cmd = launcher + cmd[2:]
            log = self.tmp / f"node{node_rank}-tp{self.tp}.log"
            proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            self.nodes.append(Node(f"node{node_rank}", proc, log))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise AssertionError(f"{node.name} exited with {node.proc.returncode} while starting\n"
                                         + "\n".join(n.tail() for n in self.nodes))
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("the head never became healthy\n" + "\n".join(n.tail() for n in self.nodes))

    def stop(self) -> None:
        for node in self.nodes:
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)  # the node's tree: the kserve process and its ranks
            except ProcessLookupError:
                pass
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def wait_all_exit(self, timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes:
                node.proc.poll()
            if not any(node.group_alive() for node in self.nodes):
                break
            time.sleep(0.2)
        still = [node.name for node in self.nodes if node.group_alive()]
        assert not still, f"still running after {timeout}s: {still}\n" + "\n".join(n.tail() for n in self.nodes)
        return {node.name: node.proc.returncode for node in self.nodes}


@pytest.fixture(scope="module")
def dense_tiny_dir(tiny_k2_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint with its FP8 weights dequantized to fp32 (no quantization_config).

    Token parity with one process is a property of the control plane only when every rank computes in
    plain floating point: with FP8 activations, a sum's order (all-reduce vs one matmul) can flip a
    quantization step and then a near-tied greedy token of the random tiny model.
    """
    import shutil

    import safetensors.torch

    from kserve.kernels.fp8_dequant import dequantize_blocks_torch

    out = tmp_path_factory.mktemp("dense") / "k2"
    shutil.copytree(tiny_k2_dir, out)
    config = json.loads((out / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    (out / "config.json").write_text(json.dumps(config))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = safetensors.torch.load_file(out / shard)
        dense = {}
        for name, tensor in tensors.items():
            if name.endswith("_scale_inv"):
                continue
            scale = tensors.get(name + "_scale_inv")
            dense[name] = dequantize_blocks_torch(tensor, scale, block) if scale is not None else tensor
        safetensors.torch.save_file(dense, out / shard)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("_scale_inv")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


@pytest.fixture
def make_cluster(tmp_path, dense_tiny_dir):
    clusters: list[Cluster] = []

    def make(tp: int, nnodes: int = 2, torchrun: bool = False) -> Cluster:
        cluster = Cluster(tmp_path, dense_tiny_dir, tp, nnodes, torchrun)
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="module")
def single_process_texts(dense_tiny_dir) -> list[str]:
    """Greedy completions of PROMPTS from one process (TP=1), the reference."""
    from kserve.engine.llm import LLM
    from kserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, skip_special_tokens=False)
    llm = LLM(model=str(dense_tiny_dir), dtype="float32", device="cpu", num_kv_blocks=64)
    return [out.text for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def _greedy_texts(cluster: Cluster) -> list[str]:
    body = {"model": "x", "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [c["text"] for c in choices]


def _live_requests_pass(cluster: Cluster) -> None:
    models = httpx.get(f"{cluster.url}/v1/models", timeout=30)
    assert models.status_code == 200
    chat = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=120, json={
        "model": "x", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1
    events = []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=120, json={
            "model": "x", "prompt": "count:", "max_tokens": 3, "stream": True, "ignore_eos": True}) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)


class _HealthWatch:
    """Polls /health from a thread; records when it first answered 503."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.first_503: float | None = None
        self.statuses: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set() and self.first_503 is None:
                try:
                    status = str(client.get(f"{self.url}/health").status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                if status == "503":
                    self.first_503 = time.monotonic()
                if not self.statuses or self.statuses[-1] != status:
                    self.statuses.append(status)
                time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _kill_during_stream(cluster: Cluster, victim_pid: int) -> tuple[list[str], float, _HealthWatch]:
    """Start a long stream, SIGKILL `victim_pid` after its first token; returns (events, kill time, watch)."""
    events: list[str] = []
    watch = None
    killed_at = 0.0
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=60, json={
            "model": "x", "prompt": [5, 6, 7], "max_tokens": 500, "stream": True, "ignore_eos": True}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if watch is None:
                watch = _HealthWatch(cluster.url)
                os.kill(victim_pid, signal.SIGKILL)
                killed_at = time.monotonic()
    assert watch is not None, "the stream produced no event"
    return events, killed_at, watch


def test_two_nodes_one_rank_each(make_cluster, single_process_texts) -> None:
    cluster = make_cluster(tp=2)
    assert _greedy_texts(cluster) == single_process_texts
    _live_requests_pass(cluster)

    headless = cluster.nodes[1].proc.pid  # with one rank per node, that process is rank 1
    events, killed_at, watch = _kill_during_stream(cluster, headless)
    assert any('"error"' in e for e in events[1:]), events[-3:]  # the stream ended with an in-band error
    deadline = killed_at + 5.0
    while watch.first_503 is None and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.stop()
    assert watch.first_503 is not None and watch.first_503 - killed_at <= 5.0, watch.statuses
    codes = cluster.wait_all_exit(EXIT_TIMEOUT_S)
    print(f"rank 1 killed: /health 503 after {watch.first_503 - killed_at:.2f}s, every process gone after "
          f"{time.monotonic() - killed_at:.1f}s, exit codes {codes}")
    assert codes["node0"] != 0, cluster.nodes[0].tail()
    assert codes["node1"] == -signal.SIGKILL


def test_two_nodes_two_ranks_each_and_the_head_dies(make_cluster, single_process_texts) -> None:
    cluster = make_cluster(tp=4)
    assert _greedy_texts(cluster) == single_process_texts
    _live_requests_pass(cluster)

    os.kill(cluster.nodes[0].proc.pid, signal.SIGKILL)  # the head: rank 0 and the HTTP server
    killed_at = time.monotonic()
    codes = cluster.wait_all_exit(EXIT_TIMEOUT_S)  # node 1's kserve process and its spawned rank 3
    print(f"head killed: every process gone after {time.monotonic() - killed_at:.1f}s, exit codes {codes}")
    assert codes["node1"] != 0, cluster.nodes[1].tail()
    assert "rank 2 stops" in cluster.nodes[1].log.read_text(errors="replace")


def test_sigterm_drains_the_stream_in_flight_then_stops_every_rank(make_cluster) -> None:
    cluster = make_cluster(tp=2)  # the head (rank 0) and a headless node (rank 1)
    events: list[str] = []
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=60, json={
            "model": "x", "prompt": [5, 6, 7], "max_tokens": 8, "stream": True, "ignore_eos": True}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: "):
                if not events:
                    cluster.nodes[0].proc.send_signal(signal.SIGTERM)
                events.append(line)
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events[-3:]
    codes = cluster.wait_all_exit(EXIT_TIMEOUT_S)
    # uvicorn re-raises the SIGTERM once its graceful shutdown is done: 0 or -SIGTERM, after a clean stop
    assert codes["node0"] in (0, -signal.SIGTERM), cluster.nodes[0].tail()
    log = cluster.nodes[0].log.read_text(errors="replace")
    assert "Application shutdown complete" in log, log[-2000:]
    assert codes["node1"] == 0, cluster.nodes[1].tail()  # it got rank 0's SHUTDOWN
    assert "rank 1: rank 0 shut the engine down" in cluster.nodes[1].log.read_text(errors="replace")


@pytest.mark.slow
def test_torchrun_ranks_come_from_its_environment(make_cluster, single_process_texts) -> None:
    cluster = make_cluster(tp=2, nnodes=1, torchrun=True)  # torchrun's RANK 0 serves, RANK 1 is headless
    assert _greedy_texts(cluster) == single_process_texts
    log = cluster.nodes[0].log.read_text(errors="replace")
    assert "kserve headless node 0: ranks 1..1 of 2" in log, log[-2000:]
    cluster.nodes[0].proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks
    cluster.wait_all_exit(EXIT_TIMEOUT_S)


def test_a_lost_local_rank_is_seen_at_once_and_kills_the_engine(tiny_k2_dir) -> None:
    """The process monitor, not a failed collective, notices first: rank 0 is idle when rank 1 dies."""
    from kserve.engine.errors import EngineDeadError
    from kserve.engine.llm import LLM
    from kserve.engine.sampling_params import SamplingParams
    from kserve.engine.tp_workers import RankLostError

    llm = LLM(model=str(tiny_k2_dir), tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=64)
    workers = llm.engine.tp_workers
    try:
        os.kill(workers._local.procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while workers.failure is None and time.monotonic() - killed_at < 5.0:
            time.sleep(0.05)
        assert isinstance(workers.failure, RankLostError) and "rank 1" in str(workers.failure)
        with pytest.raises(EngineDeadError, match="rank 1"):  # fatal at the first step: no retries
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        started = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - started < 15.0  # a broken group never makes shutdown hang
    assert not dist.is_initialized()
