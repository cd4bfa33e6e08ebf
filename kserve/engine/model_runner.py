"""Owns the model and its paged latent KV cache; turns each scheduled step into one forward.

A step's sequences are flattened, decodes first, into `StepInputs` (host lists every tensor-parallel rank gets),
then into one `ForwardBatch`; only the rows that sample go through the LM head.
Details: docs/engine.md, 'Model runner'.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kserve.config import EngineConfig, ModelConfig
from kserve.distributed import ContextParallelGroup
from kserve.engine.scheduler import ScheduledSeq
from kserve.model.forward_batch import DEFAULT_CONTEXT_CHUNK_TOKENS, ForwardBatch, local_slots, slot_of

logger = logging.getLogger(__name__)


# CUDA-graph pools are captured after the cache is allocated, so the profile cannot see them.
CUDA_GRAPH_RESERVE_BYTES = 512 << 20


@dataclass(frozen=True)
class MemoryProfile:
    """One rank's device memory after loading, measured by `profile_memory`."""

    total_bytes: int
    weights_bytes: int  # allocated by torch before the profiling forward (the loaded model)
    peak_activation_bytes: int  # the forward's peak allocation above the weights (its scratch cache excluded)
    non_torch_bytes: int  # used on the device outside torch's allocator (CUDA context, NCCL, cuBLAS)


def num_kv_blocks_for(
    config: EngineConfig, bytes_per_token: int, device: torch.device, profile: MemoryProfile | None = None
) -> int:
    """How many cache blocks fit in the memory the config allows.

    Blocks are per rank (`block_size` tokens each, whatever the DCP size).
    CUDA: `gpu_memory_utilization` of the device's total memory, less the weights, the profiled peak
    activations and what torch does not allocate (`kserve.model.memory_plan.kv_cache_budget_bytes`),
    less a reserve for CUDA graphs unless `enforce_eager`. Without a profile the activations count as
    zero. CPU: `kv_cache_cpu_bytes`. The runner's scratch block comes out of the budget too.
    """
    from kserve.model.memory_plan import kv_blocks_for_budget, kv_cache_budget_bytes

    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cuda":
        if profile is None:
            free, total = torch.cuda.mem_get_info(device)
            allocated = torch.cuda.memory_allocated(device)
            profile = MemoryProfile(total, allocated, 0, max(0, total - free - torch.cuda.memory_reserved(device)))
        graphs = 0 if config.enforce_eager else CUDA_GRAPH_RESERVE_BYTES
        budget = kv_cache_budget_bytes(
            profile.total_bytes, config.gpu_memory_utilization, profile.weights_bytes,
            profile.peak_activation_bytes, profile.non_torch_bytes + graphs,
        )
        blocks = kv_blocks_for_budget(budget, bytes_per_token, config.block_size, reserved_blocks=1)
        if blocks < 1:
            gib = 1 << 30
            raise ValueError(
                f"no room for the KV cache: {config.gpu_memory_utilization} x {profile.total_bytes / gib:.2f} GiB "
                f"leaves {budget / gib:.2f} GiB after weights {profile.weights_bytes / gib:.2f} GiB, activations "
                f"{profile.peak_activation_bytes / gib:.2f} GiB and {(profile.non_torch_bytes + graphs) / gib:.2f} GiB "
                "outside torch; raise --gpu-memory-utilization, lower --max-num-batched-tokens or use more ranks"
            )
        return blocks
    return max(1, kv_blocks_for_budget(config.kv_cache_cpu_bytes, bytes_per_token, config.block_size, reserved_blocks=1))


@contextlib.contextmanager
def local_collectives(model: Any) -> Iterator[None]:
    """Within the block, every module's `parallel` state has its collectives replaced by local
    stand-ins of the same shapes (`ParallelState.without_collectives`): one rank can run a forward
    alone, e.g. to measure memory. The numbers it computes are meaningless."""
    swapped = []
    for module in model.modules():
        state = getattr(module, "parallel", None)
        if state is not None and hasattr(state, "without_collectives"):
            swapped.append((module, state))
            module.parallel = state.without_collectives()
    try:
        yield
    finally:
        for module, state in swapped:
            module.parallel = state


@torch.inference_mode()
def profile_memory(
    model: Any, model_config: ModelConfig, config: EngineConfig, device: torch.device, kv_cache_dtype: torch.dtype
) -> MemoryProfile:
    """CUDA only: run one forward of `max_num_batched_tokens` tokens (one prefill, the largest step
    the scheduler makes) over a cached prefix of `context_chunk_tokens` (so the chunked context path
    runs with its largest chunk) and the LM head for up to `max_num_seqs` rows, on a scratch cache
    just big enough, and measure the peak memory it allocates above the loaded weights.

    Under tensor parallelism rank 0 profiles alone (ranks are symmetric): the model's collectives are
    swapped for local stand-ins of the same shapes for this one forward, so no other rank takes part.
    """
    from kserve.model.forward_batch import ForwardBatch

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens = config.max_num_batched_tokens
    if config.max_model_len:
        tokens = min(tokens, config.max_model_len)
    prefix = config.context_chunk_tokens
    if config.max_model_len:
        prefix = max(0, min(prefix, config.max_model_len - tokens))
    blocks = -(-(tokens + prefix) // config.block_size)
    cache = torch.zeros(
        model_config.num_hidden_layers, blocks, config.block_size, model_config.kv_cache_dim,
        dtype=kv_cache_dtype, device=device,
    )
    cache_bytes = cache.numel() * cache.element_size()
    with local_collectives(model):
        batch = ForwardBatch.contiguous(
            [tokens], [tokens + prefix], config.block_size, device=device, context_chunk_tokens=config.context_chunk_tokens
        )
        ids = torch.randint(0, model_config.vocab_size, (tokens,), device=device)
        hidden = model(ids, batch, cache)
        model.compute_logits(hidden[-min(config.max_num_seqs, tokens):])
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del cache, hidden, batch, ids
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    profile = MemoryProfile(total, weights, max(0, peak - weights - cache_bytes), non_torch)
    logger.info(
        "memory profile: %.2f GiB total, weights %.2f GiB, peak activations %.2f GiB at %d tokens, %.2f GiB outside torch",
        total / 2**30, weights / 2**30, profile.peak_activation_bytes / 2**30, tokens, non_torch / 2**30,
    )
    return profile


@dataclass
class StepInputs:
    """One step, host side: what every tensor-parallel rank needs to run the same forward.

    Sequences are ordered decodes (query_len 1) first; `sample_rows` are in scheduled order.
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]  # one row per sequence, unpadded
    query_lens: list[int]
    context_lens: list[int]
    sample_rows: list[int]  # rows of the flat batch whose logits are sampled, in scheduled order
    padded_batch_size: int | None = None  # decode-only step run on the static buffers at this size
    # image embeddings that replace these rows' token embeddings (rank 0 encodes; the step carries them)
    mm_rows: list[int] | None = None
    mm_embeds: Any = None  # [len(mm_rows), hidden]


class StepBroadcaster(Protocol):
    """Sends each step to the other tensor-parallel ranks (see tp_workers.py)."""

    def broadcast(self, inputs: StepInputs) -> None: ...


def decode_batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes: 1, 2, 4, 8, then multiples of 16 ... up to max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sorted(set(sizes) | {max_num_seqs})


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    if isinstance(kv_cache_dtype, torch.dtype):
        return kv_cache_dtype
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")


@dataclass
class _StaticDecodeInputs:
    """Persistent device buffers for padded decode steps (CUDA graphs replay over them)."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [max_batch] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32 = arange
    batches: dict[int, ForwardBatch]  # per bucket, views of the buffers above
    hidden: dict[int, torch.Tensor]  # per captured bucket, the graph's output


class ModelRunner:
    """Owns the model and its paged latent KV cache; turns scheduled steps into ForwardBatches and runs them.

    The cache has one scratch block past the block manager's `num_blocks`: padded decode rows
    (CUDA-graph buckets) write their latents there and have context length 0, so no real sequence
    is ever touched by padding.
    Decode-only steps run over persistent buffers padded to a bucket size (`decode_batch_buckets`),
    replaying a CUDA graph captured at start-up, when `static_decode` is on: by default on CUDA with
    one rank and not `enforce_eager` (tensor-parallel ranks would have to capture together).
    `static_decode=True` on the CPU runs the same padded path eagerly (for tests).
    """

    def __init__(
        self,
        model: Any,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        peers: StepBroadcaster | None = None,
        *,
        kv_cache_dtype: str | torch.dtype = "auto",
        kv_scale: float = 1.0,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        static_decode: bool | None = None,
        context_chunk_tokens: int = DEFAULT_CONTEXT_CHUNK_TOKENS,
        context_parallel: ContextParallelGroup | None = None,
        batch_invariant: bool = False,
        aux_hidden_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        if batch_invariant:  # decided once, before anything runs (see KimiK2ForCausalLM.set_batch_invariant)
            model.set_batch_invariant(True)
        self.model_config = model_config
        self.block_size = block_size  # tokens per cache block on this rank
        self.context_parallel = context_parallel
        self.context_chunk_tokens = context_chunk_tokens
        # tokens per block of the scheduler's block tables (a virtual block spans the DCP group)
        self.table_block_size = block_size * (context_parallel.size if context_parallel is not None else 1)
        self.device = torch.device(device)
        self.peers = peers
        self.num_blocks = num_blocks
        self.kv_scale = float(kv_scale)
        if not self.kv_scale > 0:
            raise ValueError(f"kv_scale must be positive, got {kv_scale}")
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        self.kv_cache = torch.zeros(
            model_config.num_hidden_layers,
            num_blocks + 1,  # + the scratch block for padding rows
            block_size,
            model_config.kv_cache_dim,
            dtype=self.kv_cache_dtype,
            device=self.device,
        )
        self.scratch_slot = num_blocks * block_size
        max_len = max_model_len if max_model_len is not None else num_blocks * self.table_block_size
        self.max_blocks_per_seq = -(-max_len // self.table_block_size)

        # EAGLE-3: the residual stream entering these layers is kept for the draft after each step (rank 0)
        self.aux_hidden_layers = tuple(aux_hidden_layers)
        self.last_aux_hidden: torch.Tensor | None = None  # [num_tokens, len(layers) * hidden], flat batch order
        self.last_row_starts: list[int] = []  # first flat-batch row of each scheduled sequence, scheduled order
        tp_size = getattr(getattr(model, "parallel", None), "tp_size", 1)
        if static_decode is None:
            static_decode = (self.device.type == "cuda" and not enforce_eager and tp_size == 1 and peers is None
                             and not self.aux_hidden_layers)
        self.decode_buckets = decode_batch_buckets(max_num_seqs) if static_decode else []
        self.static: _StaticDecodeInputs | None = self._make_static_inputs() if static_decode else None
        self.graphs: dict[int, Any] = {}
        if self.static is not None and self.device.type == "cuda":
            self.capture_decode_graphs()

    # ------------------------------------------------------------------ step preparation (host)
    def release(self) -> None:
        """Free the KV cache, captured graphs and the model (the engine is shutting down): a process that builds
        engines one after another (tests, benchmarks) must not keep each one's cache."""
        self.graphs = {}
        self.static = None
        self.kv_cache = torch.empty(0, device=self.device)
        self.model = None

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        """Flatten a step's scheduled sequences into StepInputs, decodes first."""
        order = list(enumerate(scheduled))
        seen_prefill = reordered = False
        for item in scheduled:
            if item.num_new_tokens != 1:
                seen_prefill = True
            elif seen_prefill:
                reordered = True
                break
        if reordered:  # e.g. a newly admitted sequence whose prompt was all but one token cached
            order = [p for p in order if p[1].num_new_tokens == 1] + [p for p in order if p[1].num_new_tokens != 1]
        bs = self.table_block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_keys: list[int] = []  # scheduled index of each sampled row
        row_starts = [0] * len(scheduled)
        mm_rows: list[int] = []
        mm_parts: list[torch.Tensor] = []
        for index, item in order:
            seq = item.seq
            row_starts[index] = len(input_ids)
            start = seq.num_computed_tokens
            table = seq.block_table
            tables.append(table)
            if item.num_new_tokens == 1:  # decode: the common case, kept cheap
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(slot_of(table, start, bs))
                query_lens.append(1)
                context_lens.append(start + 1)
                end = start + 1
            elif item.num_draft_tokens:  # verify: the last token and its drafts, every position sampled
                count = item.num_new_tokens
                input_ids.append(seq.token_ids[start])
                input_ids.extend(item.draft_token_ids)
                positions.extend(range(start, start + count))
                slots.extend(slot_of(table, p, bs) for p in range(start, start + count))
                query_lens.append(count)
                context_lens.append(start + count)
                first_row = len(input_ids) - count
                sample_rows.extend(range(first_row, first_row + count))
                sample_keys.extend([index] * count)
                continue
            else:
                end = start + item.num_new_tokens
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(slot_of(table, p, bs) for p in range(start, end))
                query_lens.append(item.num_new_tokens)
                context_lens.append(end)
            if getattr(seq, "image_embeds", None) is not None:  # scheduler stand-ins in tests carry none
                self._image_rows(seq, start, end, row_starts[index], mm_rows, mm_parts)
            if end == len(seq.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sample_keys.append(index)
        if reordered:
            sample_rows = [row for _, row in sorted(zip(sample_keys, sample_rows))]
        self.last_row_starts = row_starts
        padded = None
        if (
            self.decode_buckets
            and len(input_ids) == len(order) <= self.decode_buckets[-1]
            and max(map(len, tables)) <= self.max_blocks_per_seq
        ):
            padded = next(b for b in self.decode_buckets if b >= len(order))
        inputs = StepInputs(input_ids, positions, slots, tables, query_lens, context_lens, sample_rows, padded)
        if mm_rows:
            inputs.padded_batch_size = None
            inputs.mm_rows, inputs.mm_embeds = mm_rows, torch.cat(mm_parts)
        return inputs

    @staticmethod
    def _image_rows(seq: Any, start: int, end: int, row_start: int, rows: list[int], parts: list) -> None:
        """The flat-batch rows of positions [start, end) that hold image placeholders, and their embeddings
        (a chunk may cut through an image: it takes that image's slice)."""
        offset = 0
        for first, length in seq.image_spans:
            lo, hi = max(start, first), min(end, first + length)
            if lo < hi:
                rows.extend(range(row_start + lo - start, row_start + hi - start))
                parts.append(seq.image_embeds[offset + lo - first : offset + hi - first])
            offset += length

    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run one step; return float32 logits for the sampling rows, in scheduled order (a verified
        sequence has one row per position: its last token's, then each draft's)."""
        inputs = self.prepare(scheduled)
        if self.peers is not None:
            self.peers.broadcast(inputs)
        return self.execute(inputs)

    # ------------------------------------------------------------------ the forward
    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """The forward for StepInputs; every tensor-parallel rank runs exactly this."""
        if inputs.padded_batch_size is not None:
            hidden = self._execute_padded(inputs, inputs.padded_batch_size)
        else:
            batch = ForwardBatch.build(
                positions=inputs.positions,
                slots=inputs.slots,
                block_tables=inputs.block_tables,
                query_lens=inputs.query_lens,
                context_lens=inputs.context_lens,
                block_size=self.block_size,
                device=self.device,
                kv_scale=self.kv_scale,
                context_chunk_tokens=self.context_chunk_tokens,
                context_parallel=self.context_parallel,
                scratch_slot=self.scratch_slot,
            )
            input_ids = torch.tensor(inputs.input_ids, dtype=torch.long).to(self.device, non_blocking=True)
            extra: dict[str, Any] = {}  # only what the step has: a model without images need not take them
            if inputs.mm_rows:
                rows = torch.tensor(inputs.mm_rows, dtype=torch.long).to(self.device, non_blocking=True)
                extra["images"] = (rows, inputs.mm_embeds.to(self.device))
            if self.aux_hidden_layers:
                hidden, self.last_aux_hidden = self.model(input_ids, batch, self.kv_cache, self.aux_hidden_layers,
                                                          **extra)
            else:
                hidden = self.model(input_ids, batch, self.kv_cache, **extra)
        if not inputs.sample_rows:
            return torch.empty(0, 0, device=self.device)
        rows = torch.tensor(inputs.sample_rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()

    # ------------------------------------------------------------------ padded decode / CUDA graphs
    def _make_static_inputs(self) -> _StaticDecodeInputs:
        max_batch = self.decode_buckets[-1]
        dev = self.device
        static = _StaticDecodeInputs(
            input_ids=torch.zeros(max_batch, dtype=torch.long, device=dev),
            positions=torch.zeros(max_batch, dtype=torch.long, device=dev),
            slot_mapping=torch.full((max_batch,), self.scratch_slot, dtype=torch.long, device=dev),
            block_tables=torch.zeros(max_batch, self.max_blocks_per_seq, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(max_batch, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=dev),
            batches={},
            hidden={},
        )
        for size in self.decode_buckets:
            static.batches[size] = ForwardBatch(
                positions=static.positions[:size],
                slot_mapping=static.slot_mapping[:size],
                block_tables=static.block_tables[:size],
                context_lens=static.context_lens[:size],
                query_start_loc=static.query_start_loc[: size + 1],
                query_lens=[1] * size,
                context_lens_host=[0] * size,  # not read on the decode path; the device copy is live
                block_size=self.block_size,
                num_decode_seqs=size,
                prefill=None,
                kv_scale=self.kv_scale,
                context_parallel=self.context_parallel,
            )
        return static

    def _fill_static(self, inputs: StepInputs, size: int) -> None:
        """Copy a decode step into the persistent buffers; rows past it become padding."""
        static = self.static
        n = len(inputs.input_ids)
        width = max(len(t) for t in inputs.block_tables)
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {width} blocks exceeds max_blocks_per_seq {self.max_blocks_per_seq}")
        step = np.empty((4, size), dtype=np.int64)
        step[0, :n], step[0, n:] = inputs.input_ids, 0
        step[1, :n], step[1, n:] = inputs.positions, 0
        step[2, :n], step[2, n:] = inputs.slots, self.scratch_slot
        step[3, :n], step[3, n:] = inputs.context_lens, 0
        dcp = self.context_parallel
        if dcp is not None:  # this rank's slots and token counts (see forward_batch.py)
            step[2, :n] = local_slots(step[2, :n], self.block_size, dcp, self.scratch_slot)
            step[3, :n] = np.maximum(0, -(-(step[3, :n] - dcp.rank) // dcp.size))
        tables = np.zeros((size, width), dtype=np.int32)
        for i, t in enumerate(inputs.block_tables):
            tables[i, : len(t)] = t
        host = torch.from_numpy(step)
        dev = host.to(self.device, non_blocking=True)
        static.input_ids[:size].copy_(dev[0])
        static.positions[:size].copy_(dev[1])
        static.slot_mapping[:size].copy_(dev[2])
        static.context_lens[:size].copy_(dev[3])
        # entries past a row's context are never read, so only the step's width is refreshed
        static.block_tables[:size, :width].copy_(torch.from_numpy(tables).to(self.device, non_blocking=True))

    def _execute_padded(self, inputs: StepInputs, size: int) -> torch.Tensor:
        if self.static is None or size not in self.static.batches:
            raise ValueError(f"padded batch size {size} is not one of this runner's buckets {self.decode_buckets}")
        self._fill_static(inputs, size)
        graph = self.graphs.get(size)
        if graph is not None:
            graph.replay()
            return self.static.hidden[size]
        return self.model(self.static.input_ids[:size], self.static.batches[size], self.kv_cache)

    def capture_decode_graphs(self) -> None:
        """Capture one CUDA graph per decode bucket, largest first, sharing one memory pool.

        Warm-up and capture write only to the scratch slot (every static row is padding then).
        If capture fails (e.g. an op that reads device data on the host), the runner stays eager.
        """
        static = self.static
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                for size in reversed(self.decode_buckets):
                    batch = static.batches[size]
                    ids = static.input_ids[:size]
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        self.model(ids, batch, self.kv_cache)  # warm-up: compiles kernels, allocates workspaces
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        static.hidden[size] = self.model(ids, batch, self.kv_cache)
                    self.graphs[size] = graph
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 -- eager decode still works
            logger.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            self.graphs.clear()
            static.hidden.clear()
