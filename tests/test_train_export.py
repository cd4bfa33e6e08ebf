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


def test_polish_stage_follows_the_main_stage_in_one_run(tmp_path):
    """--polish-steps: one command trains the main stage (here with planted loops in every conversation), then
    the polishing stage, and logs both; a run stopped early (--stop-at) skips the polish."""
    from train_tiny_chat import parser, train

    common = ["--conversations", "60", "--bpe-conversations", "60", "--vocab", "1024", "--batch-tokens", "1024",
              "--steps", "2", "--warmup", "1", "--repeat-break-share", "1",
              "--polish-steps", "1", "--polish-warmup", "1"]
    out = train(parser().parse_args(["--out", str(tmp_path / "both"), *common]))
    stages = json.loads((out / "train_log.json").read_text())["stages"]
    assert [(stage["stage"], len(stage["log"])) for stage in stages] == [("train", 2), ("polish", 1)]
    assert stages[1]["log"][0]["seconds"] >= stages[0]["log"][-1]["seconds"]
    # the libraries it ran under, without which the same arguments need not give the same weights
    assert stages[0]["versions"]["torch"] == torch.__version__ and stages[0]["versions"]["transformers"]
    out = train(parser().parse_args(["--out", str(tmp_path / "stopped"), *common, "--stop-at", "1"]))
    assert [len(stage["log"]) for stage in json.loads((out / "train_log.json").read_text())["stages"]] == [1]
