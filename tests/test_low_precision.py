"""fp32 and bf16 inference on the CPU: linear layers with their bias, GELU and residual addition fused into
oneDNN's matrix product (vitlab.mixers.base.fused_linear) compute the same function as the plain operations, and
nothing changes in float64 or when autograd records.

Tolerance: the plain bf16 path rounds the product to bf16 before adding the bias (and again after GELU or the
residual add), the fused one once at the end; both are within a few bf16 units (2^-8 relative) of the float64
result, so they agree within 4 x 2^-8 of the output's magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitlab
from vitlab.mixers.base import fused_linear, fuses_linear

BF16_UNIT = 2.0**-8


def close(actual: torch.Tensor, expected: torch.Tensor, units: float = 4.0) -> None:
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= units * BF16_UNIT * scale, f"max abs error {err:.3g} > {units} bf16 units of {scale:.3g}"


@pytest.mark.parametrize("kind", ["plain", "gelu", "residual"])
def test_fused_linear_is_the_plain_function_in_bf16(kind):
    torch.manual_seed(0)
    lin = nn.Linear(64, 96).to(torch.bfloat16)
    x, res = torch.randn(2, 7, 64, dtype=torch.bfloat16), torch.randn(2, 7, 96, dtype=torch.bfloat16)
    kw = {"gelu": kind == "gelu", "residual": res if kind == "residual" else None}
    y = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    exact = F.gelu(y) if kind == "gelu" else y + res.double() if kind == "residual" else y
    with torch.inference_mode():
        assert fuses_linear(x, lin.weight)
        fused = fused_linear(lin, x, **kw)
    assert fused.dtype == torch.bfloat16 and fused.shape == exact.shape
    close(fused, exact)
    with pytest.raises(ValueError, match="either gelu or residual"), torch.inference_mode():
        fused_linear(lin, x, gelu=True, residual=res)


FP32_UNIT = 2.0**-23


@pytest.mark.parametrize("kind", ["plain", "gelu", "residual", "broadcast residual"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_linear_is_the_plain_function_in_fp32(kind, bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias)
    x = torch.randn(3, 40, 96)[:, ::2]  # a strided view: the primitive reads it as given
    res = torch.randn(3, 20, 200) if kind == "residual" else torch.randn(200)
    kw = {"gelu": kind == "gelu", "residual": res if "residual" in kind else None}
    y = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    exact = F.gelu(y) if kind == "gelu" else y + res.double() if "residual" in kind else y
    with torch.inference_mode():
        assert fuses_linear(x, lin.weight)
        fused = fused_linear(lin, x, **kw)
    assert fused.dtype == torch.float32 and fused.shape == exact.shape
    # a 96-term fp32 dot product: within ~sqrt(96) units of its magnitude (the sum of |terms|) of float64's
    magnitude = (x.double().abs() @ lin.weight.double().abs().t()).max().item()
    assert (fused.double() - exact).abs().max().item() <= 64 * FP32_UNIT * magnitude


def test_float64_and_autograd_take_the_plain_operations():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8).double()
    x, res = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    with torch.inference_mode():
        assert not fuses_linear(x, lin.weight)
        assert torch.equal(fused_linear(lin, x, residual=res), res + lin(x))
        assert torch.equal(fused_linear(lin, x, gelu=True), F.gelu(lin(x)))
    lin = lin.float()
    assert not fuses_linear(x.float(), lin.weight)  # autograd records: the weights require grad
    for low in (lin, lin.to(torch.bfloat16)):
        x_low = x.to(low.weight.dtype).requires_grad_()
        assert not fuses_linear(x_low, low.weight)
        fused_linear(low, x_low, gelu=True).sum().backward()
        assert low.weight.grad is not None and x_low.grad is not None


@pytest.mark.parametrize("name", ["deit_mini", "cpvt_mini"])
def test_a_bf16_model_computes_the_same_function_fused_or_not(name, monkeypatch):
    import vitlab.mixers.base as base

    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10).eval().to(torch.bfloat16)
    x = torch.randn(2, *model.meta["input_size"], dtype=torch.bfloat16)
    with torch.inference_mode():
        fused = model(x)
        monkeypatch.setattr(base, "fuses_linear", lambda *a: False)
        monkeypatch.setattr(vitlab.layers.mlp, "fuses_linear", lambda *a: False)
        plain = model(x)
    close(fused, plain, units=16.0)  # 12 blocks of bf16 rounding on both paths
    fp32 = vitlab.create_model(name, num_classes=10).eval()
    fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.inference_mode():
        close(fused, fp32(x.float()), units=16.0)


@pytest.mark.parametrize("name", ["deit_mini", "cpvt_mini"])
def test_an_fp32_model_is_as_accurate_fused_as_plain(name, monkeypatch):
    """Against the same model in float64 (plain operations), the fused fp32 inference is no less accurate than
    the plain fp32 one (both round differently, by a few fp32 units)."""
    import vitlab.mixers.base as base

    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10).eval()
    x = torch.randn(2, *model.meta["input_size"])
    with torch.inference_mode():
        exact = model.double()(x.double())
        model.float()
        fused = model(x)
        monkeypatch.setattr(base, "fuses_linear", lambda *a: False)
        monkeypatch.setattr(vitlab.layers.mlp, "fuses_linear", lambda *a: False)
        plain = model(x)
    err_fused, err_plain = ((t.double() - exact).abs().max().item() for t in (fused, plain))
    assert err_fused <= 4 * err_plain + 16 * FP32_UNIT * exact.abs().max().item(), (err_fused, err_plain)


def test_autocast_keeps_its_precision():
    """Under CPU autocast an fp32 model's linear layers run in bf16 (autocast's choice), not fused in fp32."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    x = torch.randn(4, 32)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fuses_linear(x, lin.weight)
        assert fused_linear(lin, x, gelu=True).dtype == torch.bfloat16
        model = vitlab.create_model("deit_mini", num_classes=10).eval()
        assert model(torch.randn(1, *model.meta["input_size"])).dtype == torch.bfloat16
