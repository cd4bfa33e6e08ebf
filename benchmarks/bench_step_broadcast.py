"""Step broadcast cost per step: rank 0 sends one decode step's inputs to the other ranks.

A decode step at batch 256 with 8K-token contexts (by default) over the control plane
(kserve/engine/step_broadcast.py: int64 header + packed int32 payload, gloo over loopback TCP), against
the baseline in the same run: the pickled StepInputs over a multiprocessing pipe (what tp_workers.py
used before). Each iteration ends when every receiver has the step unpacked into StepInputs (an
acknowledgement closes the round trip; its cost alone is measured and shown too).

    python benchmarks/bench_step_broadcast.py [--batch 256] [--context 8192] [--block-size 16] [--ranks 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kserve.engine.model_runner import StepInputs
from kserve.engine.step_broadcast import (
    MessageKind,
    StepChannel,
    pack_step,
    unpack_step,
)


def decode_step(batch: int, context: int, block_size: int) -> StepInputs:
    blocks = -(-context // block_size)
    tables = [list(range(seq * blocks, (seq + 1) * blocks)) for seq in range(batch)]
    return StepInputs(
        input_ids=[(7 * seq) % 163840 for seq in range(batch)],
        positions=[context - 1] * batch,
        slots=[table[-1] * block_size + (context - 1) % block_size for table in tables],
        block_tables=tables,
        query_lens=[1] * batch,
        context_lens=[context] * batch,
        sample_rows=list(range(batch)),
        padded_batch_size=None,
    )


def _receiver(rank: int, world: int, init_file: str, iters: int, raw_numel: int, conn) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    control = dist.new_group(backend="gloo")
    channel = StepChannel(control)
    ack = torch.zeros(1)
    for _ in range(iters):  # ack round trips alone
        dist.all_reduce(ack, group=control)
    raw = torch.empty(raw_numel, dtype=torch.int32)
    for _ in range(iters):  # the payload alone, no packing
        dist.broadcast(raw, 0, group=control)
        dist.all_reduce(ack, group=control)
    while True:
        message = channel.receive()
        if message.kind == MessageKind.SHUTDOWN:
            break
        dist.all_reduce(ack, group=control)
    # the baseline: pickled StepInputs over a pipe (rank 1 only), acknowledged over the pipe
    if conn is not None:
        while True:
            inputs = conn.recv()
            if inputs is None:
                break
            conn.send(len(inputs.input_ids))
    dist.destroy_process_group()


def run(batch: int, context: int, block_size: int, ranks: int, iters: int) -> dict:
    step = decode_step(batch, context, block_size)
    header, payload = pack_step(step)
    fd, init_file = tempfile.mkstemp(prefix="kserve-bench-")
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_receiver, args=(r, ranks, init_file, iters, payload.numel(), child if r == 1 else None))
             for r in range(1, ranks)]
    for p in procs:
        p.start()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=ranks,
                            timeout=datetime.timedelta(seconds=120))
    control = dist.new_group(backend="gloo")
    channel = StepChannel(control)
    ack = torch.zeros(1)

    def timed(fn) -> list[float]:
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    ack_ms = timed(lambda: dist.all_reduce(ack, group=control))

    def raw_round() -> None:
        dist.broadcast(payload, 0, group=control)
        dist.all_reduce(ack, group=control)

    raw_ms = timed(raw_round)

    def broadcast_round() -> None:
        channel.send_step(step)
        dist.all_reduce(ack, group=control)

    broadcast_ms = timed(broadcast_round)
    channel.send_shutdown()
    pack_ms = timed(lambda: pack_step(step))
    unpack_ms = timed(lambda: unpack_step(header, payload))
    # what a receiver does next with the step: its ForwardBatch, from the broadcast's array tables or
    # from the pickled lists (the baseline's)
    from kserve.model.forward_batch import ForwardBatch

    def build(inputs: StepInputs) -> None:
        ForwardBatch.build(positions=inputs.positions, slots=inputs.slots, block_tables=inputs.block_tables,
                           query_lens=inputs.query_lens, context_lens=inputs.context_lens,
                           block_size=block_size, device=torch.device("cpu"))

    received = unpack_step(header, payload)
    build_broadcast_ms = timed(lambda: build(received))
    build_lists_ms = timed(lambda: build(step))

    def pipe_round() -> None:
        parent.send(step)
        parent.recv()

    pipe_ms = timed(pipe_round)
    parent.send(None)
    for p in procs:
        p.join(60)
    dist.destroy_process_group()
    med = statistics.median
    result = {
        "batch": batch, "context": context, "block_size": block_size, "ranks": ranks, "iters": iters,
        "payload_bytes": payload.numel() * payload.element_size(),
        "pack_ms": med(pack_ms), "unpack_ms": med(unpack_ms),
        "broadcast_round_ms": med(broadcast_ms), "ack_only_ms": med(ack_ms),
        "broadcast_ms_net_of_ack": med(broadcast_ms) - med(ack_ms),
        "payload_only_round_ms": med(raw_ms),
        "pipe_pickle_round_ms (baseline)": med(pipe_ms),
        "receiver_batch_build_ms": med(build_broadcast_ms),
        "receiver_batch_build_ms (baseline, lists)": med(build_lists_ms),
    }
    result["ratio_broadcast_vs_pipe"] = result["broadcast_round_ms"] / result["pipe_pickle_round_ms (baseline)"]
    result["ratio_with_receiver_build"] = (
        (result["broadcast_round_ms"] + result["receiver_batch_build_ms"])
        / (result["pipe_pickle_round_ms (baseline)"] + result["receiver_batch_build_ms (baseline, lists)"]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--block-size", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    for block_size in args.block_size:
        print(json.dumps(run(args.batch, args.context, block_size, args.ranks, args.iters)))


if __name__ == "__main__":
    main()
