"""Two gloo processes (heads split, experts split) give the single-process logits."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kserve.distributed import ParallelState
from kserve.model import ForwardBatch, load_model

BLOCK = 16


def run_steps(model, ids: torch.Tensor) -> torch.Tensor:
    """Prefill then 3 greedy decode steps; returns all logits rows."""
    c = model.config
    cache = torch.zeros(c.num_hidden_layers, 8, BLOCK, c.kv_cache_dim)
    n = ids.shape[0]
    logits = [model.compute_logits(model(ids, ForwardBatch.contiguous([n], [n], BLOCK), cache))]
    for step in range(3):
        tok = logits[-1][-1].argmax()[None]
        logits.append(model.compute_logits(model(tok, ForwardBatch.contiguous([1], [n + step + 1], BLOCK), cache)))
    return torch.cat(logits)


def _worker(rank: int, world: int, model_dir: str, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = load_model(model_dir, parallel=ParallelState(tp_rank=rank, tp_size=world, group=dist.group.WORLD))
        ids = torch.arange(5, 5 + 19 * 7, 7)
        logits = run_steps(model, ids)
        if rank == 0:
            torch.save(logits, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is unavailable")
def test_two_rank_gloo_matches_single_process(tiny_k2_dir, tmp_path):
    out = tmp_path / "tp.pt"
    mp.spawn(_worker, args=(2, str(tiny_k2_dir), str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    tp_logits = torch.load(out)
    ref = run_steps(load_model(tiny_k2_dir), torch.arange(5, 5 + 19 * 7, 7))
    err = ((tp_logits - ref).abs().max() / ref.abs().max()).item()
    print(f"tp=2 vs tp=1 max rel err {err:.3e}")
    assert err <= 1e-5
