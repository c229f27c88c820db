"""Models whose attention needs no map never build one: DeiT/ViT, CPVT, TNT (inner and outer attention) and EAMLP
train and infer through ``F.scaled_dot_product_attention`` (FlashAttention / memory-efficient kernels on a GPU),
and only a request for the maps (``forward_trace``) takes the explicit path, which gives the same outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.mixers import attention as attention_module


@pytest.fixture
def counted(monkeypatch):
    """Counts of explicit maps and of SDPA calls, with the dispatch a CUDA device gets (the CPU-only choice of the
    explicit map for TNT's short inner sequences switched off)."""
    calls = {"map": 0, "sdpa": 0}
    real_map, real_sdpa = attention_module.attention_map, F.scaled_dot_product_attention

    def explicit(*args, **kwargs):
        calls["map"] += 1
        return real_map(*args, **kwargs)

    def sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention_module, "attention_map", explicit)
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(attention_module.Attention, "_explicit_trains_faster", lambda self, q: False)
    return calls


@pytest.mark.parametrize("name", ["deit_mini", "cpvt_mini", "tnt_mini"])
def test_training_and_inference_take_sdpa_and_no_map(counted, name):
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=5).train()
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    with torch.no_grad():
        out = model.eval()(x)
    assert counted["map"] == 0 and counted["sdpa"] > 0
    trace = model.forward_trace(x)  # maps asked for: the explicit path, the same function
    assert counted["map"] > 0
    torch.testing.assert_close(model.forward_head(trace["features"]), out, rtol=1e-5, atol=1e-6)


def test_eamlp_builds_no_attention_map(counted):
    model = vitlab.create_model("eamlp_mini", num_classes=5).train()
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert counted == {"map": 0, "sdpa": 0}
