"""scripts/train_tiny_chat.py's export: a mid-run export (--export-every, routed experts still under INT4
fake quantization) writes the same tensors as the final one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from train_tiny_chat import export_checkpoint_tensors, fake_quantize_experts, unfake_experts


def test_export_while_experts_are_fake_quantized_matches_the_final_export():
    from transformers import DeepseekV3ForCausalLM

    from kserve.model.hf_reference import hf_config
    from kserve.tiny import embedded_model_dir

    wrapper = json.loads((embedded_model_dir() / "config.json").read_text())
    cfg = {**wrapper["text_config"], "eos_token_id": wrapper["eos_token_id"]}
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(hf_config(embedded_model_dir())).float()
    faked = fake_quantize_experts(model, 32)
    mid_run = export_checkpoint_tensors(model, cfg)
    unfake_experts(faked)
    final = export_checkpoint_tensors(model, cfg)
    assert mid_run.keys() == final.keys() and any("experts.3.down_proj" in name for name in final)
    for name, tensor in final.items():
        assert torch.equal(mid_run[name], tensor), name
