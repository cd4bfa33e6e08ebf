"""The control plane's wire format: rank 0 tells every other rank what to do next, over torch.distributed.

Each message is one fixed-size int64 header broadcast from rank 0, then (for most kinds) one packed payload tensor
whose size the header gives, so no Python object is pickled on the hot path. Every value of a step fits in int32;
`pack_step` refuses a step that does not rather than truncating it. Layout: docs/multinode.md, 'Control plane'.
"""

from __future__ import annotations

import enum
import itertools
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kserve.engine.model_runner import StepInputs

HEADER_LEN = 8
_INT32_MAX = 2**31 - 1


class MessageKind(enum.IntEnum):
    STEP = 1
    HEARTBEAT = 2
    SHUTDOWN = 3
    INIT = 4


@dataclass
class Message:
    kind: MessageKind
    step: StepInputs | None = None
    init: Any = None


def pack_step(inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(header int64[HEADER_LEN], payload int32[n]) for one step, on the CPU."""
    num_tokens = len(inputs.input_ids)
    num_seqs = len(inputs.query_lens)
    tables = inputs.block_tables
    if len(inputs.positions) != num_tokens or len(inputs.slots) != num_tokens:
        raise ValueError(f"StepInputs: positions ({len(inputs.positions)}) and slots ({len(inputs.slots)}) "
                         f"must match input_ids ({num_tokens})")
    if len(inputs.context_lens) != num_seqs or len(tables) != num_seqs:
        raise ValueError(f"StepInputs: context_lens ({len(inputs.context_lens)}) and block_tables "
                         f"({len(tables)}) must match query_lens ({num_seqs})")
    table_lens = [len(t) for t in tables]
    num_entries = sum(table_lens)
    flat_tables = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=num_entries)
    parts = [
        np.asarray(inputs.input_ids, dtype=np.int64),
        np.asarray(inputs.positions, dtype=np.int64),
        np.asarray(inputs.slots, dtype=np.int64),
        np.asarray(inputs.query_lens, dtype=np.int64),
        np.asarray(inputs.context_lens, dtype=np.int64),
        np.asarray(table_lens, dtype=np.int64),
        flat_tables,
        np.asarray(inputs.sample_rows, dtype=np.int64),
        np.asarray(inputs.mm_rows or [], dtype=np.int64),
    ]
    packed = np.concatenate(parts)
    if packed.size and (packed.max() > _INT32_MAX or packed.min() < -_INT32_MAX - 1):
        raise ValueError(f"StepInputs: a value ({int(packed.max())}) does not fit the step wire format (int32)")
    padded = -1 if inputs.padded_batch_size is None else inputs.padded_batch_size
    header = torch.tensor(
        [MessageKind.STEP, num_tokens, num_seqs, num_entries, len(inputs.sample_rows), padded, packed.size,
         len(inputs.mm_rows or [])],
        dtype=torch.int64,
    )
    return header, torch.from_numpy(packed.astype(np.int32))


def unpack_step(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    """The StepInputs that `pack_step` packed (header and payload on any device); its `block_tables` are
    int32 numpy arrays (views of the payload), every other field plain lists."""
    _, num_tokens, num_seqs, num_entries, num_sample, padded, size, num_image_rows = header.tolist()
    values = payload.cpu().numpy()
    if values.size != size:
        raise ValueError(f"step payload has {values.size} values, header says {size}")
    cuts = np.cumsum([num_tokens, num_tokens, num_tokens, num_seqs, num_seqs, num_seqs, num_entries, num_sample])
    ids, pos, slots, qlens, clens, tlens, flat, sample, image_rows = np.split(values, cuts)
    # block tables stay int32 array views of the payload: the bulk of a step, and ForwardBatch.build
    # copies array rows far faster than Python lists (an unused list round trip cost ~2 ms at batch 256, 8K)
    tables = np.split(flat, np.cumsum(tlens)[:-1]) if num_seqs else []
    return StepInputs(
        input_ids=ids.tolist(),
        positions=pos.tolist(),
        slots=slots.tolist(),
        block_tables=tables,  # type: ignore[arg-type]  # a sequence of int sequences, as the runner reads it
        query_lens=qlens.tolist(),
        context_lens=clens.tolist(),
        sample_rows=sample.tolist(),
        padded_batch_size=None if padded < 0 else padded,
        mm_rows=image_rows.tolist() if num_image_rows else None,
    )


def _bare_header(kind: MessageKind, payload_len: int = 0) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = int(kind)
    header[6] = payload_len
    return header


class StepChannel:
    """Broadcasts control messages from rank `src` (rank 0) over `group`; every other rank receives them.

    Not thread-safe: the sender serializes its calls (see TensorParallelWorkers). `device` is where the
    tensors travel: "cpu" for a gloo group, the rank's CUDA device for an NCCL group.
    """

    def __init__(self, group: Any, device: torch.device | str = "cpu", src: int = 0,
                 embed_width: int | None = None) -> None:
        self.group = group
        self.device = torch.device(device)
        self.src = src
        self.embed_width = embed_width  # the model's hidden size: the width of image embeddings a step may carry
        self._header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)

    def _send(self, header: torch.Tensor, payload: torch.Tensor | None) -> None:
        dist.broadcast(header.to(self.device), self.src, group=self.group)
        if payload is not None and payload.numel():
            dist.broadcast(payload.to(self.device), self.src, group=self.group)

    # ------------------------------------------------------------------ sender (rank 0)
    def send_step(self, inputs: StepInputs) -> None:
        self._send(*pack_step(inputs))
        if inputs.mm_rows:
            dist.broadcast(inputs.mm_embeds.float().contiguous().to(self.device), self.src, group=self.group)

    def send_init(self, value: Any) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        self._send(_bare_header(MessageKind.INIT, data.numel()), data)

    def send_heartbeat(self) -> None:
        self._send(_bare_header(MessageKind.HEARTBEAT), None)

    def send_shutdown(self) -> None:
        self._send(_bare_header(MessageKind.SHUTDOWN), None)

    # ------------------------------------------------------------------ receivers
    def receive(self) -> Message:
        dist.broadcast(self._header, self.src, group=self.group)
        header = self._header.cpu()
        kind = MessageKind(int(header[0]))
        size = int(header[6])
        if kind in (MessageKind.HEARTBEAT, MessageKind.SHUTDOWN):
            return Message(kind)
        dtype = torch.int32 if kind == MessageKind.STEP else torch.uint8
        payload = torch.empty(size, dtype=dtype, device=self.device)
        if size:
            dist.broadcast(payload, self.src, group=self.group)
        if kind == MessageKind.INIT:
            return Message(kind, init=pickle.loads(payload.cpu().numpy().tobytes()))
        step = unpack_step(header, payload)
        if step.mm_rows:
            if self.embed_width is None:
                raise RuntimeError("a step with image embeddings reached a channel that does not know the hidden size")
            embeds = torch.empty(len(step.mm_rows), self.embed_width, dtype=torch.float32, device=self.device)
            dist.broadcast(embeds, self.src, group=self.group)
            step.mm_embeds = embeds
        return Message(kind, step=step)
