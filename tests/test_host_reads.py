"""A decode forward never reads device data on the host.

Dynamo traces the whole decode step (model forward + compute_logits for a decode-only batch) with
`fullgraph=True`: any `.item()`, `.tolist()`, `nonzero`, `unique`, boolean-mask indexing or branch on a
tensor's value is a graph break or a data-dependent guard, and fullgraph turns either into an error.
The kernels are custom ops with fake implementations, so they trace as opaque calls. The same check
is shown to fail on a deliberate `.item()` and on the old per-expert MoE loop.
"""

from __future__ import annotations

import pytest
import torch

from kserve.model import ForwardBatch, load_model

BLOCK = 16


def trace_fullgraph(fn, *args):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")(*args)


def test_a_host_read_is_caught() -> None:
    def reads_back(x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # the host read this check exists to catch
            return x * 2
        return x

    with pytest.raises(Exception, match=r"(?i)item|data-dependent|graph break"):
        trace_fullgraph(reads_back, torch.ones(3))


@pytest.fixture(scope="module", params=["k2", "k25"])
def decode_setup(request):
    """The FP8 model and K2.6's INT4-expert model."""
    model = load_model(request.getfixturevalue(f"tiny_{request.param}_dir"))
    c = model.config
    cache = torch.zeros(c.num_hidden_layers, 16, BLOCK, c.kv_cache_dim)
    prompts = [torch.arange(3, 3 + 17), torch.arange(40, 40 + 5), torch.arange(100, 100 + 33)]
    lens = [p.numel() for p in prompts]
    model(torch.cat(prompts), ForwardBatch.contiguous(lens, lens, BLOCK), cache)
    # one decode token each; the first crosses a block boundary, the last fills block 3's first slot
    batch = ForwardBatch.contiguous([1, 1, 1], [n + 1 for n in lens], BLOCK)
    return model, cache, batch


def test_decode_forward_traces_whole(decode_setup) -> None:
    model, cache, batch = decode_setup
    assert batch.is_decode_only

    def decode_step(ids, batch, cache):
        return model.compute_logits(model(ids, batch, cache))

    ids = torch.tensor([7, 8, 9])
    traced = trace_fullgraph(decode_step, ids, batch, cache.clone())
    eager = decode_step(ids, batch, cache.clone())
    torch.testing.assert_close(traced, eager)


def test_padding_rows_trace_and_give_finite_outputs(decode_setup) -> None:
    """A CUDA-graph bucket's padding rows: context length 0 and a scratch slot."""
    model, cache, batch = decode_setup
    scratch = cache.shape[1] * BLOCK - 1  # the last slot of the last block, owned by no sequence above
    padded = ForwardBatch(
        positions=torch.cat([batch.positions, torch.zeros(1, dtype=torch.long)]),
        slot_mapping=torch.cat([batch.slot_mapping, torch.tensor([scratch])]),
        block_tables=torch.cat([batch.block_tables, torch.zeros(1, batch.block_tables.shape[1], dtype=torch.int32)]),
        context_lens=torch.cat([batch.context_lens, torch.zeros(1, dtype=torch.int32)]),
        query_start_loc=torch.arange(5, dtype=torch.int32),
        query_lens=[1] * 4,
        context_lens_host=batch.context_lens_host + [0],
        block_size=BLOCK,
        num_decode_seqs=4,
        prefill=None,
    )

    def decode_step(ids, batch, cache):
        return model.compute_logits(model(ids, batch, cache))

    ids = torch.tensor([7, 8, 9, 0])
    out = trace_fullgraph(decode_step, ids, padded, cache.clone())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_step(ids, padded, cache.clone()))
    # (padded against unpadded numbers: tests/test_decode_path.py, with dequantized weights)


def test_a_host_read_in_the_moe_would_fail(decode_setup, monkeypatch) -> None:
    """A MoE that reads its routing on the host (as a per-expert loop's unique().tolist() does) breaks the trace."""
    import kserve.layers.moe as moe

    model, cache, batch = decode_setup
    name = "fused_moe_w4a16" if model.config.int4_group_size else "fused_moe"
    real = getattr(moe, name)

    def reads_routing(x, w13, w2, weights, ids, *rest):
        torch.unique(ids).tolist()
        return real(x, w13, w2, weights, ids, *rest)

    monkeypatch.setattr(moe, name, reads_routing)

    def decode_step(ids, batch, cache):
        return model.compute_logits(model(ids, batch, cache))

    with pytest.raises(Exception, match=r"(?i)data-dependent|item|tolist|graph break"):
        trace_fullgraph(decode_step, torch.tensor([7, 8, 9]), batch, cache.clone())


def test_context_parallel_decode_traces_whole(decode_setup) -> None:
    """Decode context parallelism (group rank 1 of 2, collectives as local stand-ins): the head gather, the
    decode kernel with log-sum-exp and the merge trace without a host read."""
    from kserve.distributed import ContextParallelGroup
    from kserve.model.forward_batch import slot_of

    model, cache, _ = decode_setup
    group = ContextParallelGroup(2, 1, collectives=False)
    lens = [18, 6, 34]
    tables = [[0, 1], [2], [3, 4, 5]]  # virtual blocks of 2 * BLOCK tokens
    batch = ForwardBatch.build(
        positions=[n - 1 for n in lens], slots=[slot_of(t, n - 1, 2 * BLOCK) for t, n in zip(tables, lens)],
        block_tables=tables, query_lens=[1, 1, 1], context_lens=lens, block_size=BLOCK,
        context_parallel=group, scratch_slot=cache.shape[1] * BLOCK - 1,
    )
    assert batch.context_lens.tolist() == [9, 3, 17]  # this rank's share: positions 1, 3, 5, ...

    def decode_step(ids, batch, cache):
        return model.compute_logits(model(ids, batch, cache))

    ids = torch.tensor([7, 8, 9])
    out = trace_fullgraph(decode_step, ids, batch, cache.clone())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, decode_step(ids, batch, cache.clone()))
