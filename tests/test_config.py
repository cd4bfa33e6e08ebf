import json
from pathlib import Path

import pytest

from kserve.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def test_k2_config_facts():
    cfg = ModelConfig.from_dict(json.loads((REPO / "configs" / "kimi-k2-instruct.json").read_text()))
    assert cfg.model_type == "kimi_k2"
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (384, 8, 1)
    assert cfg.kv_cache_dim == 576
    assert cfg.qk_head_dim == 192
    assert cfg.quantization_config.weight_block_size == (128, 128)
    # K2-Instruct: factor 32, mscale_all_dim 1 -> 192^-0.5 * (0.1 ln 32 + 1)^2
    assert cfg.softmax_scale == pytest.approx(0.130861, abs=1e-6)
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)


def test_shared_config_matches_configs_copy():
    path = SHARED / "kimi_k2" / "config.json"
    if not path.is_file():
        pytest.skip("../shared/kimi_k2/config.json is absent")
    ours = ModelConfig.from_dict(json.loads((REPO / "configs" / "kimi-k2-instruct.json").read_text()))
    assert ModelConfig.from_model_dir(path.parent) == ours


def test_rejects_unknown_model_type():
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_dict({"model_type": "llama"})
