"""kv_b_proj's regrouped storage, which gives the absorbed MLA path contiguous W_UK / W_UV."""

from __future__ import annotations

import pytest
import torch

from kserve.distributed import ParallelState
from kserve.layers.linear import LatentUpProjection


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_b_proj_regroups_keys_before_values_for_its_heads(tp):
    heads, nope, v_head, latent = 4, 6, 5, 16
    checkpoint = torch.randn(heads * (nope + v_head), latent)
    per_head = checkpoint.view(heads, nope + v_head, latent)
    for rank in range(tp):
        layer = LatentUpProjection(latent, heads, nope, v_head, ParallelState(rank, tp), dtype=torch.float32,
                                   device="cpu")
        rows = layer.weight.checkpoint_slice[0]
        layer.weight.weight_loader(layer.weight, checkpoint[rows])
        mine = per_head[rank * heads // tp : (rank + 1) * heads // tp]
        w_uk, w_uv = layer.absorption_weights()
        assert w_uk.is_contiguous() and w_uv.is_contiguous()
        assert torch.equal(w_uk, mine[:, :nope]) and torch.equal(w_uv, mine[:, nope:])
        c_kv = torch.randn(3, latent)
        out = layer(c_kv)  # every head's keys, then every head's values
        local = heads // tp
        expect = torch.einsum("tc,hdc->thd", c_kv, mine)
        assert torch.allclose(out[:, : local * nope].view(3, local, nope), expect[..., :nope], atol=1e-5)
        assert torch.allclose(out[:, local * nope :].view(3, local, v_head), expect[..., nope:], atol=1e-5)
