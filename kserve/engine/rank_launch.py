"""Where each tensor-parallel rank runs: nodes, ranks per node, the rendezvous address, the timeouts.

Ranks are numbered node by node: node n holds global ranks [n * ranks_per_node, (n + 1) * ranks_per_node).
Rank 0 (node 0) is the engine and the HTTP server; every other rank runs a worker loop. A `kserve serve`
process hosts its node's first rank itself and spawns the node's other ranks, unless torchrun started
one process per rank (`from_torchrun_env`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# EngineConfig.extra key under which `kserve serve` passes the RankLayout to LLMEngine.from_config.
RANK_LAYOUT_KEY = "rank_layout"


@dataclass(frozen=True)
class RankLayout:
    """The placement of `world_size` tensor-parallel ranks over `nnodes` nodes.

    - `master_addr`/`master_port`: rank 0's TCP store, which every rank dials to rendezvous; port None
      (one node only) picks a free loopback port.
    - `spawn_local_ranks`: this process starts its node's other ranks (False under torchrun).
    - `rank`: this process's global rank (the node's first rank unless torchrun says otherwise);
      `local_rank` its GPU index on the node.
    - `collective_timeout_s`: any collective (and the rendezvous) that waits longer fails.
    - `control_timeout_s`: a worker that hears nothing from rank 0 this long (rank 0 sends a heartbeat
      every `heartbeat_interval_s` while idle) decides rank 0 is gone and exits non-zero.
    - `exit_after_failure_s`: once a rank is lost, the process exits with status 1 after this long
      even if something still blocks (the server's last resort; None = never, for library use).
    - `use_agent_store`: torchrun already hosts the TCP store on master_port; every rank is a client.
    """

    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    spawn_local_ranks: bool = True
    rank: int | None = None
    local_rank: int | None = None
    collective_timeout_s: float = 300.0
    control_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    ready_timeout_s: float = 3600.0
    exit_after_failure_s: float | None = None
    use_agent_store: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.world_size}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.world_size % self.nnodes:
            raise ValueError(f"--tp {self.world_size} is not divisible by --nnodes {self.nnodes}: "
                             f"every node holds the same number of ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need --master-addr and --master-port (rank 0's rendezvous address)")
        if self.rank is not None and not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world_size} ranks")
        for name in ("collective_timeout_s", "control_timeout_s", "heartbeat_interval_s", "ready_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_interval_s * 3 > self.control_timeout_s:
            raise ValueError(f"control_timeout_s ({self.control_timeout_s}) must be at least 3 heartbeat "
                             f"intervals ({self.heartbeat_interval_s} s)")

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def first_rank(self) -> int:
        """The first global rank on this node."""
        return self.node_rank * self.ranks_per_node

    @property
    def this_rank(self) -> int:
        return self.first_rank if self.rank is None else self.rank

    def local_index(self, rank: int) -> int:
        """`rank`'s device index on its node."""
        if self.local_rank is not None and rank == self.this_rank:
            return self.local_rank
        return rank % self.ranks_per_node

    @property
    def spawned_ranks(self) -> list[int]:
        """The ranks this process starts as child processes."""
        if not self.spawn_local_ranks:
            return []
        return list(range(self.first_rank + 1, self.first_rank + self.ranks_per_node))


def from_torchrun_env(env: Mapping[str, str] | None = None, **options: object) -> RankLayout | None:
    """The layout torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT, and LOCAL_WORLD_SIZE for the node count), or None outside torchrun."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env["RANK"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None
    except ValueError as exc:
        raise ValueError(f"torchrun environment variable is not an integer: {exc}") from None
    if local_world < 1 or world % local_world:
        raise ValueError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}")
    return RankLayout(
        world_size=world,
        nnodes=world // local_world,
        node_rank=rank // local_world,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=port,
        spawn_local_ranks=False,
        rank=rank,
        local_rank=local_rank,
        use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        **options,  # type: ignore[arg-type]
    )


def layout_for_serve(
    tensor_parallel_size: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    headless: bool = False,
    collective_timeout_s: float = 300.0,
    exit_after_failure_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> RankLayout | None:
    """The layout `kserve serve` runs with: torchrun's when its environment is set (then --nnodes,
    --node-rank and the address flags are ignored), else the flags'; None for a single rank."""
    options = {"collective_timeout_s": collective_timeout_s, "exit_after_failure_s": exit_after_failure_s}
    layout = from_torchrun_env(env, **options)
    if layout is not None:
        if layout.world_size != tensor_parallel_size:
            raise ValueError(f"torchrun started {layout.world_size} processes (WORLD_SIZE) but --tp is "
                             f"{tensor_parallel_size}: give --tp {layout.world_size}")
        return layout
    if tensor_parallel_size == 1 and nnodes == 1:
        if headless:
            raise ValueError("--headless is for the other nodes of a multi-node --tp; this is a single rank")
        return None
    layout = RankLayout(world_size=tensor_parallel_size, nnodes=nnodes, node_rank=node_rank,
                        master_addr=master_addr, master_port=master_port, **options)  # type: ignore[arg-type]
    if headless and node_rank == 0:
        raise ValueError("node 0 holds rank 0, which serves HTTP: --headless is for --node-rank 1 and up")
    if not headless and node_rank != 0:
        raise ValueError(f"--node-rank {node_rank} holds no HTTP server: start it with --headless")
    return layout
