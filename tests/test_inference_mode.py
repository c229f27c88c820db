"""An evaluation under ``torch.inference_mode()`` never breaks the training that follows it.

Evaluation loops run models under inference mode between epochs. A cache that a module builds during such a
pass (band masks, position tables at another size) outlives it; if it held inference tensors, the next
training step would fail ("Inference tensors cannot be saved for backward") or differ. For every mixer kind
(causal too) and every architecture, a training step after an inference-mode pass must give exactly the
gradients of a training step in a fresh process state.
"""

from __future__ import annotations

import copy

import pytest
import torch

import vitlab
from vitlab.mixers import TokenLayout, build
from vitlab.mixers.aft_banded import _band_masks

DIM, GRID = 32, (6, 6)
N = GRID[0] * GRID[1]

MIXER_CASES = {
    "attention": dict(num_heads=4),
    "attention_causal": dict(kind="attention", num_heads=4, causal=True),
    "refiner": dict(num_heads=4, expansion=2),
    "reattention": dict(num_heads=4),
    "external": dict(memory_size=16),
    "external_mh": dict(num_heads=4),
    "aft_full": dict(max_len=N),
    "aft_full_causal": dict(kind="aft_full", max_len=N, causal=True),
    "aft_local": dict(max_len=N, window=5),  # N > window: the banded path
    "aft_local_causal": dict(kind="aft_local", max_len=N, window=5, causal=True),
    "aft_simple": {},
    "aft_simple_causal": dict(kind="aft_simple", causal=True),
    "aft_conv": dict(num_heads=4, kernel_size=3),
}


def gradients(module: torch.nn.Module, step) -> dict[str, torch.Tensor]:
    module.train()
    module.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout / drop-path draws in both runs
    step(module).square().mean().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def check_inference_then_train(module: torch.nn.Module, step) -> None:
    _band_masks.cache_clear()  # whatever an earlier test built, this one's inference pass builds it first
    fresh = copy.deepcopy(module)
    module.eval()
    with torch.inference_mode():
        step(module)  # may fill the module's caches with tensors made under inference mode
    after = gradients(module, step)
    expected = gradients(fresh, step)
    assert after.keys() == expected.keys() and after
    for name, g in expected.items():
        torch.testing.assert_close(after[name], g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("case", list(MIXER_CASES))
def test_mixer_trains_after_inference_mode(case):
    opts = dict(MIXER_CASES[case])
    kind = opts.pop("kind", case)
    torch.manual_seed(0)
    mixer = build(kind, DIM, **opts)
    x = torch.randn(2, N, DIM)
    layout = TokenLayout(grid=GRID, num_prefix=0)
    check_inference_then_train(mixer, lambda m: m(x, layout))


@pytest.mark.parametrize("name", vitlab.list_models("*_mini"))
def test_model_trains_after_inference_mode(name):
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10)
    x = torch.randn(2, *model.meta["input_size"])
    check_inference_then_train(model, lambda m: m(x))


def test_model_at_another_size_trains_after_inference_mode():
    # T2T recomputes its sinusoid table for another token count and keeps it
    torch.manual_seed(0)
    model = vitlab.create_model("eamlp_mini", num_classes=10, img_size=40)
    x = torch.randn(2, 3, 40, 40)
    check_inference_then_train(model, lambda m: m(x))
