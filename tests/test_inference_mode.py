"""An evaluation under ``torch.inference_mode()`` or ``torch.no_grad()`` never breaks the training that follows.

Evaluation loops run models under inference mode (or no_grad) between epochs. A cache that a module builds during
such a pass (band masks, position tables at another size) outlives it; if it held inference tensors, the next
training step would fail ("Inference tensors cannot be saved for backward"), and if it held a tensor derived from
parameters without its graph, the gradients would silently differ. For every mixer kind (causal too) and every
architecture, a training step after such a pass must give the gradients of a training step in a fresh
process state, and no state a module keeps may be an inference tensor.

"Every architecture": the default suite runs the ``*_mini`` rows (one per family); the slow test runs every
registered configuration (distilled, SE, DLA, the official stems, ...) at a small input size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch

import vitlab
from vitlab.mixers import TokenLayout, build
from vitlab.ops.aft_banded import _band_masks

DIM, GRID = 32, (6, 6)
N = GRID[0] * GRID[1]

MIXER_CASES = {
    "attention": dict(num_heads=4),
    "attention_causal": dict(kind="attention", num_heads=4, causal=True),
    "attention_explicit": dict(kind="attention", num_heads=4, fused=False),
    "refiner": dict(num_heads=4, expansion=2),
    "reattention": dict(num_heads=4),
    "external": dict(memory_size=16),
    "external_mh": dict(num_heads=4),
    "aft_full": dict(max_len=N),
    "aft_full_w": dict(kind="aft_full", max_len=N, bias_dim=None),
    "aft_full_causal": dict(kind="aft_full", max_len=N, causal=True),
    "aft_local": dict(max_len=N, window=5),  # N > window: the banded path
    "aft_local_w": dict(kind="aft_local", max_len=N, window=5, bias_dim=None),
    "aft_local_causal": dict(kind="aft_local", max_len=N, window=5, causal=True),
    "aft_simple": {},
    "aft_simple_causal": dict(kind="aft_simple", causal=True),
    "aft_conv": dict(num_heads=4, kernel_size=3),
}

# the no-autograd contexts of an evaluation loop
EVAL_CONTEXTS: dict[str, Callable[[], AbstractContextManager]] = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
}

SMALL_IMG = 32  # the slow test builds every named configuration at this input size (same modules, cheap)


def gradients(module: torch.nn.Module, step) -> dict[str, torch.Tensor]:
    module.train()
    module.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout / drop-path draws in both runs
    step(module).square().mean().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def kept_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a module keeps between calls: buffers and plain attributes (caches), at any depth, and the
    band masks AFT-local's module-level cache handed out."""
    found = {f"buffer {n}": b for n, b in module.named_buffers()}
    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            items = value if isinstance(value, tuple | list) else (value,)
            found.update({f"{name}.{attr}[{i}]": t for i, t in enumerate(items) if isinstance(t, torch.Tensor)})
    found.update({f"band mask {i}": t for i, t in enumerate(t for masks in BAND_MASKS for t in masks)})
    return found


BAND_MASKS: list[tuple[torch.Tensor, ...]] = []  # what the cached _band_masks returned during a test


@pytest.fixture(autouse=True)
def record_band_masks(monkeypatch):
    import vitlab.ops.aft_banded as banded

    def recording(*args):
        BAND_MASKS.append(_band_masks(*args))
        return BAND_MASKS[-1]

    BAND_MASKS.clear()
    monkeypatch.setattr(banded, "_band_masks", recording)
    yield
    BAND_MASKS.clear()


def check_eval_then_train(module: torch.nn.Module, step, context: str) -> None:
    _band_masks.cache_clear()  # whatever an earlier test built, this one's evaluation pass builds it first
    fresh = copy.deepcopy(module)
    module.eval()
    with EVAL_CONTEXTS[context]():
        step(module)  # may fill the module's caches with tensors made there
    leaked = [name for name, t in kept_tensors(module).items() if t.is_inference()]
    assert not leaked, f"inference tensors kept after the pass: {leaked}"
    after = gradients(module, step)
    expected = gradients(fresh, step)
    assert after.keys() == expected.keys() and after
    # the same computation twice; some CPU backward kernels (depth-wise conv weights) reduce in a thread-dependent
    # order, so equal means equal up to fp32 rounding of the model's largest gradient (a lost or detached graph
    # changes gradients at their own scale)
    atol = 64 * torch.finfo(torch.float32).eps * max(g.abs().max().item() for g in expected.values())
    for name, g in expected.items():
        torch.testing.assert_close(after[name], g, rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("context", list(EVAL_CONTEXTS))
@pytest.mark.parametrize("case", list(MIXER_CASES))
def test_mixer_trains_after_evaluation(case, context):
    opts = dict(MIXER_CASES[case])
    kind = opts.pop("kind", case)
    torch.manual_seed(0)
    mixer = build(kind, DIM, **opts)
    x = torch.randn(2, N, DIM)
    layout = TokenLayout(grid=GRID, num_prefix=0)
    check_eval_then_train(mixer, lambda m: m(x, layout), context)


def _check_model(name: str, context: str, **overrides) -> None:
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10, **overrides)
    x = torch.randn(2, *model.meta["input_size"])
    check_eval_then_train(model, lambda m: m(x), context)


@pytest.mark.parametrize("context", list(EVAL_CONTEXTS))
@pytest.mark.parametrize("name", vitlab.list_models("*_mini"))
def test_model_trains_after_evaluation(name, context):
    _check_model(name, context)


@pytest.mark.parametrize("context", list(EVAL_CONTEXTS))
def test_model_at_another_size_trains_after_evaluation(context):
    # T2T recomputes its sinusoid table for another token count and keeps it
    _check_model("eamlp_mini", context, img_size=40)


@pytest.mark.slow
@pytest.mark.parametrize("name", vitlab.list_models())
def test_every_registered_model_trains_after_inference_mode(name):
    _check_model(name, "inference_mode", img_size=SMALL_IMG)
