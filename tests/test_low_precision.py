"""Linear layers on the CPU through oneDNN where its primitive runs (vitlab.ops.linear.fused_linear): in fp32 and bf16 inference with
their bias, GELU and residual addition fused into the product, in fp32 training with the forward and both
gradient products in oneDNN's GEMM (OneDNNLinear); each computes the same function and gradients as the plain
operations, and nothing changes in float64, under autocast or while a dispatch mode watches the ops.

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
from vitlab.ops.linear import fused_linear, fuses_linear, trains_linear_in_onednn
from vitlab.ops.onednn import ONEDNN_WEIGHT_GRAD_MIN

BF16_UNIT = 2.0**-8


def close(actual: torch.Tensor, expected: torch.Tensor, units: float = 4.0) -> None:
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= units * BF16_UNIT * scale, f"max abs error {err:.3g} > {units} bf16 units of {scale:.3g}"


@pytest.mark.parametrize("kind", ["plain", "gelu", "residual"])
def test_fused_linear_is_the_plain_function_in_bf16(kind, onednn_linear):
    onednn_linear(torch.bfloat16)
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
def test_fused_linear_is_the_plain_function_in_fp32(kind, bias, onednn_linear):
    onednn_linear(torch.float32)
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
    assert not trains_linear_in_onednn(x.requires_grad_(), lin.weight)  # float64 training: plain
    lin = lin.float()
    assert not fuses_linear(x.float(), lin.weight)  # autograd records: the weights require grad
    for low in (lin, lin.to(torch.bfloat16)):
        x_low = x.detach().to(low.weight.dtype).requires_grad_()
        assert not fuses_linear(x_low, low.weight)
        fused_linear(low, x_low, gelu=True).sum().backward()
        assert low.weight.grad is not None and x_low.grad is not None


def _abs_product(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest sum of |terms| of ``a @ b``: the scale of a dot product's fp32 rounding error."""
    return (a.double().abs() @ b.double().abs()).max().item()


@pytest.mark.parametrize("kind", ["plain", "gelu", "residual", "broadcast residual"])
@pytest.mark.parametrize("bias", [True, False])
# the weight gradient in aten's BLAS product (width < 128), in oneDNN from (xᵀ g)ᵀ (a widening layer, 144 -> 160)
# and from gᵀ x (a narrowing one, 200 -> 160)
@pytest.mark.parametrize("width", [96, 144, 200])
def test_fp32_training_products_give_the_plain_values_and_gradients(kind, bias, width, onednn_linear):
    onednn_linear(torch.float32, training=True)
    torch.manual_seed(0)
    lin = nn.Linear(width, 160, bias=bias)
    x = torch.randn(3, 40, width)[:, ::2].requires_grad_()  # a strided view
    res = (torch.randn(3, 20, 160) if kind == "residual" else torch.randn(160)).requires_grad_()
    kw = {"gelu": kind == "gelu", "residual": res if "residual" in kind else None}
    g = torch.randn(3, 20, 160)
    assert trains_linear_in_onednn(x, lin.weight) and (min(width, 160) >= ONEDNN_WEIGHT_GRAD_MIN) == (width > 96)
    out = fused_linear(lin, x, **kw)
    out.backward(g)
    got = [
        out,
        x.grad,
        lin.weight.grad,
        *([lin.bias.grad] if bias else []),
        *([res.grad] if kw["residual"] is not None else []),
    ]
    # float64 autograd through the plain operations, on the same values
    x64, res64 = x.detach().double().requires_grad_(), res.detach().double().requires_grad_()
    lin64 = nn.Linear(width, 160, bias=bias).double()
    lin64.load_state_dict(lin.state_dict())
    y = lin64(x64)
    exact = F.gelu(y) if kw["gelu"] else y + res64 if kw["residual"] is not None else y
    exact.backward(g.double())
    want = [
        exact,
        x64.grad,
        lin64.weight.grad,
        *([lin64.bias.grad] if bias else []),
        *([res64.grad] if kw["residual"] is not None else []),
    ]
    g2, x2 = g.reshape(-1, 160), x.detach().reshape(-1, width)
    scales = [
        _abs_product(x2, lin.weight.detach().t()),
        _abs_product(g2, lin.weight.detach()),
        _abs_product(g2.t(), x2),
    ]
    scales += [g2.abs().sum(0).max().item()] * (len(got) - 3)
    for name, a, b, scale in zip(["out", "x", "weight", "bias/residual", "residual"], got, want, scales):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert (a.double() - b).abs().max().item() <= 64 * FP32_UNIT * scale, name


def test_fp32_training_takes_onednn_only_where_it_may(onednn_linear):
    onednn_linear(torch.float32, training=True)
    onednn_linear(torch.float32)
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    x = torch.randn(4, 32, requires_grad=True)
    assert trains_linear_in_onednn(x, lin.weight)
    assert trains_linear_in_onednn(x.detach(), lin.weight)  # the first layer: gradients for the weights only
    out = fused_linear(lin, x.detach())
    assert type(out.grad_fn).__name__ == "OneDNNLinearBackward"
    out.sum().backward()
    assert lin.weight.grad is not None
    with torch.no_grad():
        assert not trains_linear_in_onednn(x, lin.weight)  # nothing recorded: the inference path
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not trains_linear_in_onednn(x, lin.weight) and fused_linear(lin, x).dtype == torch.bfloat16
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:  # counts oneDNN's operators as it counts aten's products
        out = fused_linear(lin, x)
        assert type(out.grad_fn).__name__ == "OneDNNLinearBackward"
        out.sum().backward()
        with torch.inference_mode():
            fused_linear(lin, x, gelu=True)
    assert counter.get_total_flops() == 4 * 2 * 4 * 32 * 48
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:  # shape propagation, as torch.compile and export do it
        fx = fake.from_tensor(x)
        assert fused_linear(lin, fx, residual=fake.from_tensor(torch.randn(4, 48))).shape == (4, 48)
    with pytest.raises(RuntimeError, match="once_differentiable"):  # no second derivative: an error, not a zero
        (gx,) = torch.autograd.grad(fused_linear(lin, x).square().sum(), x, create_graph=True)
        gx.sum().backward()


@pytest.mark.parametrize("k, n", [(512, 256), (128, 512)])
def test_fp32_weight_gradient_copy_does_not_meet_the_input_gradient(k, n, onednn_linear):
    """The weight gradient's primitive copies its left operand to contiguous memory: gᵀ (M x N) for a narrowing
    layer, xᵀ (M x K) and then the (K x N) result for a widening one. Computed before the input gradient (M x K),
    that copy never coexists with it: the backward pass peaks less than the smaller copy above aten's (exact
    allocation record, not the RSS; oneDNN's own scratch space is a few hundred KiB)."""
    from vitlab.measure.process import tensor_peak_bytes

    onednn_linear(torch.float32, training=True)
    torch.manual_seed(0)
    m = 1024
    lin, x, g = nn.Linear(k, n), torch.randn(m, k, requires_grad=True), torch.randn(m, n)
    assert trains_linear_in_onednn(x, lin.weight)
    onednn_out, aten_out = fused_linear(lin, x), lin(x)
    assert type(onednn_out.grad_fn).__name__ == "OneDNNLinearBackward"
    inputs = (x, lin.weight, lin.bias)
    onednn = tensor_peak_bytes(lambda: torch.autograd.grad(onednn_out, inputs, g, retain_graph=True))
    aten = tensor_peak_bytes(lambda: torch.autograd.grad(aten_out, inputs, g, retain_graph=True))
    assert onednn is not None and aten is not None
    assert aten >= 4 * (m * k + n * k)  # the record sees both gradients
    copy = 4 * m * n if n <= k else 4 * (m * k + n * k)
    assert copy <= 4 * m * n and onednn < aten + copy, (onednn, aten)


def test_torch_func_transforms_take_the_plain_operations(onednn_linear):
    """Per-sample gradients (vmap of grad) through a layer: torch.func has rules for aten's ops, not for the
    oneDNN function; the result equals the loop over samples."""
    from torch.func import functional_call, grad, vmap

    onednn_linear(torch.float32, training=True)
    torch.manual_seed(0)
    lin = nn.Linear(160, 192)
    params = {k: v.detach() for k, v in lin.named_parameters()}

    def loss(p, x):
        return functional_call(_FusedLinear(lin), {f"lin.{k}": v for k, v in p.items()}, (x,)).square().sum()

    x = torch.randn(4, 1, 160)
    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(4):
        torch.testing.assert_close(per_sample["weight"][i], grad(loss)(params, x[i])["weight"])
        lin.zero_grad(set_to_none=True)
        fused_linear(lin, x[i]).square().sum().backward()  # eager autograd: the oneDNN products
        torch.testing.assert_close(per_sample["weight"][i], lin.weight.grad, rtol=1e-5, atol=1e-5)


class _FusedLinear(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_linear(self.lin, x)


def test_compiled_training_keeps_the_onednn_products_in_the_graph(onednn_linear):
    """Under torch.compile the products are vitlab's registered operators (no graph break, not the BLAS's mm;
    inductor lowers oneDNN's primitive only for frozen weights) and give eager's values and gradients, through
    inductor itself."""
    onednn_linear(torch.float32, training=True)
    torch.manual_seed(0)
    lin = nn.Linear(160, 192)
    x = torch.randn(2, 10, 160, requires_grad=True)
    res = torch.randn(2, 10, 192)

    def step(fn):
        lin.zero_grad(set_to_none=True)
        x.grad = None
        out = fn(x)
        out.square().sum().backward()
        return [out.detach(), x.grad, lin.weight.grad, lin.bias.grad]

    def block(t):
        return fused_linear(lin, F.layer_norm(t, (160,)), residual=res)

    eager = step(block)
    torch._dynamo.reset()
    assert torch._dynamo.explain(block)(x).graph_break_count == 0
    from torch._dynamo.backends.common import aot_autograd

    ops: list[str] = []

    def record(gm, example_inputs):  # the forward and the backward graph after AOT autograd
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    step(torch.compile(block, backend=aot_autograd(fw_compiler=record, bw_compiler=record)))
    assert sum("vitlab.onednn_linear" in op for op in ops) == 3, ops  # the forward and both gradient products
    assert not any(op.startswith(("aten.mm", "aten.addmm")) for op in ops), ops
    torch._dynamo.reset()
    for a, b in zip(step(torch.compile(block)), eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # inductor reorders the layer norm's sums


@pytest.mark.parametrize("name", ["deit_mini", "refiner_vit_mini"])
def test_an_fp32_model_trains_as_accurately_in_onednn_as_plain(name, onednn_linear):
    """A training step's gradients against the same model in float64: the oneDNN products are no less accurate
    than the plain fp32 ones."""
    onednn_linear(torch.float32, training=True)
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10).train()
    x = torch.randn(2, *model.meta["input_size"])

    def grads(m, inp):
        m.zero_grad(set_to_none=True)
        m(inp).square().sum().backward()
        return torch.cat([p.grad.flatten().double() for p in m.parameters() if p.grad is not None])

    exact = grads(model.double(), x.double())
    model.float()
    onednn = grads(model, x)
    with vitlab.ops.fast_paths(False):
        plain = grads(model, x)
    err_onednn, err_plain = ((g - exact).norm().item() for g in (onednn, plain))
    assert err_onednn <= 4 * err_plain + 16 * FP32_UNIT * exact.norm().item(), (err_onednn, err_plain)


@pytest.mark.parametrize("name", ["deit_mini", "cpvt_mini"])
def test_a_bf16_model_computes_the_same_function_fused_or_not(name, onednn_linear):
    onednn_linear(torch.bfloat16)
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10).eval().to(torch.bfloat16)
    x = torch.randn(2, *model.meta["input_size"], dtype=torch.bfloat16)
    with torch.inference_mode():
        fused = model(x)
        with vitlab.ops.fast_paths(False):
            plain = model(x)
    close(fused, plain, units=16.0)  # 12 blocks of bf16 rounding on both paths
    fp32 = vitlab.create_model(name, num_classes=10).eval()
    fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.inference_mode():
        close(fused, fp32(x.float()), units=16.0)


@pytest.mark.parametrize("name", ["deit_mini", "cpvt_mini"])
def test_an_fp32_model_is_as_accurate_fused_as_plain(name, onednn_linear):
    """Against the same model in float64 (plain operations), the fused fp32 inference is no less accurate than
    the plain fp32 one (both round differently, by a few fp32 units)."""
    onednn_linear(torch.float32)
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10).eval()
    x = torch.randn(2, *model.meta["input_size"])
    with torch.inference_mode():
        exact = model.double()(x.double())
        model.float()
        fused = model(x)
        with vitlab.ops.fast_paths(False):
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
