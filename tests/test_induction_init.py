"""scripts/induction_init.py: the planted circuit copies at no fixed offset from the first step, where the same
model from its random initialization does not (docs/embedded_model.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from copy_probe import copy_batch
from induction_init import COPY, ID, plant_induction_circuit, rope_pattern


def _model():
    from transformers import DeepseekV3ForCausalLM

    from kserve.model.hf_reference import hf_config
    from kserve.tiny import embedded_model_dir

    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(hf_config(embedded_model_dir())).float().eval()


@torch.no_grad()
def _copy_accuracy(model) -> float:
    torch.manual_seed(1)
    x, scored = copy_batch(16, 12, 3000, 100, 4000, gap=32)
    logits = model(input_ids=x).logits[:, :-1]
    return (logits.argmax(-1) == x[:, 1:])[scored[:, 1:]].float().mean().item()


def test_planted_circuit_copies_at_no_fixed_offset_and_random_weights_do_not():
    model = _model()
    assert _copy_accuracy(model) < 0.05
    plant_induction_circuit(model)
    assert _copy_accuracy(model) > 0.9


def test_rope_pattern_puts_most_attention_one_position_back():
    angles = 50000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)
    z = rope_pattern(angles, peak_logit=14.5, steps=500)
    assert z.abs().sum().item() == pytest.approx(14.5)
    distance = torch.arange(129, dtype=torch.float64)
    logits = (z[None] * torch.exp(1j * angles[None] * distance[:, None])).real.sum(-1)
    assert torch.softmax(logits, 0).argmax().item() == 1
    assert torch.softmax(logits, 0)[1].item() > 0.8


def test_a_word_and_the_word_after_a_space_share_one_identity():
    model = _model()
    plant_induction_circuit(model, token_bytes=(b"Paris", b" Paris", b" Rome", b"Rome", b" "))
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert torch.equal(embed[0, ID], embed[1, ID]) and torch.equal(embed[2, ID], embed[3, ID])
    assert not torch.equal(embed[0, ID], embed[2, ID]) and not torch.equal(embed[4, ID], embed[0, ID])
    assert torch.equal(head[0, COPY], head[1, COPY])
