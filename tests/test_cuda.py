"""The GPU, against the CPU: every mixer and every family's model computes on CUDA what it computes on the CPU
(values and gradients, float64); an evaluation under inference mode on the GPU never breaks the training that
follows; compiled training (inductor's Triton kernels) equals eager on the GPU; the command line trains with
bf16 autocast and ``--compile`` there; causal decoding on the GPU equals the full forward.

Why float64: the CPU's fast paths (oneDNN's fused linear, AFT's fused cores, the folded BatchNorms) do not run on
CUDA, so the two devices take different code paths; in float64 any difference beyond round-off is a wrong path.
AFT's cores compute in float32 whatever the model's dtype, so their modules agree to ~1e-7 relative; 1e-5 (in
norm) is far above that and far below what a wrong kernel gives.

Every test here is skipped without CUDA (CI has none): ``bash scripts/gpu_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

import vitlab
from test_compile import loss_and_grads
from test_inference_mode import DIM, GRID, MIXER_CASES, N, check_eval_then_train
from test_lm import TINY, randomise_biases
from vitlab.common.device import set_tf32
from vitlab.layers import DropPath
from vitlab.mixers import TokenLayout, build
from vitlab.tasks.lm import create_lm, shift_right
from vitlab.tasks.lm.decode import generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
TOLERANCE = 1e-5
# every mixer on a 6x6 grid; AFT-conv also behind a class token (its prefix sums)
LAYOUTS = {case: TokenLayout(grid=GRID, num_prefix=0) for case in MIXER_CASES}
CASES = {**MIXER_CASES, "aft_conv_cls": dict(kind="aft_conv", num_heads=4, kernel_size=3)}
LAYOUTS["aft_conv_cls"] = TokenLayout(grid=GRID, num_prefix=1)


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 means fp32 (no TF32 matrix products), as vitlab's default."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    set_tf32(False)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def perturb(module: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """Every parameter moved off its initial value (biases and AFT's position biases start at 0, which hides
    their terms and their gradients)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * std)
    return module


def without_dropout(module: torch.nn.Module) -> torch.nn.Module:
    """Dropout and stochastic depth off: the two devices draw different random masks."""
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout | DropPath):
            m.p = 0.0
    return module


def values_and_grads(module: torch.nn.Module, *inputs, **kwargs) -> dict[str, torch.Tensor]:
    """The output, the first input's gradient and every parameter's gradient of a training-mode call, on the CPU."""
    module.train().zero_grad(set_to_none=True)
    x = inputs[0].detach().clone().requires_grad_(True)
    out = module(x, *inputs[1:], **kwargs)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype, device=out.device)).square().sum().backward()
    found = {"output": out.detach(), "input grad": x.grad}
    found.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
    return {k: v.detach().cpu() for k, v in found.items()}


def random_in_training(model: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether two training-mode calls with different seeds differ (a mixer's own random masks)."""
    outputs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            outputs.append(copy.deepcopy(model).train()(x))
    return not torch.equal(*outputs)


def assert_same(cuda: dict[str, torch.Tensor], cpu: dict[str, torch.Tensor], rtol: float = TOLERANCE) -> None:
    """Each tensor within ``rtol`` of its norm, plus a floor of 1e-9 of the largest one's: a gradient that is zero
    in exact arithmetic (AFT-conv's β without the global context) comes out as round-off of the others' size."""
    assert cuda.keys() == cpu.keys() and len(cpu) > 2
    floor = 1e-9 * max(ref.double().norm().item() for ref in cpu.values())
    for name, ref in cpu.items():
        err = (cuda[name].double() - ref.double()).norm().item()
        assert err <= rtol * ref.double().norm().item() + floor, f"{name}: |cuda - cpu| = {err:.3g}"


@pytest.mark.parametrize("case", list(CASES))
def test_mixer_on_cuda_equals_cpu(case):
    opts = dict(CASES[case])
    kind = opts.pop("kind", case)
    layout = LAYOUTS[case]
    torch.manual_seed(0)
    mixer = without_dropout(perturb(build(kind, DIM, **opts))).double()
    twin = copy.deepcopy(mixer).to(CUDA)  # before the first call: a call may change state (running statistics)
    x = torch.randn(2, layout.num_prefix + N, DIM, dtype=torch.float64)
    assert_same(values_and_grads(twin, x.to(CUDA), layout), values_and_grads(mixer, x, layout))


@pytest.mark.parametrize("name", vitlab.list_models("*_mini"))
def test_model_on_cuda_equals_cpu(name):
    torch.manual_seed(0)
    model = without_dropout(perturb(vitlab.create_model(name, num_classes=10), std=0.02)).double()
    twin = copy.deepcopy(model).to(CUDA)  # before the first call: a call may change state (a temperature schedule)
    x = torch.randn(3, *model.meta["input_size"], dtype=torch.float64)
    if random_in_training(model, x):  # e.g. DropAttention's random maps: only the evaluation is deterministic
        model.eval(), twin.eval()
    else:
        assert_same(values_and_grads(twin, x.to(CUDA)), values_and_grads(model, x))
    with torch.inference_mode():  # the eval-mode forward (folded BatchNorms, no-autograd paths)
        torch.testing.assert_close(twin.eval()(x.to(CUDA)).cpu(), model.eval()(x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", list(MIXER_CASES))
def test_mixer_on_cuda_trains_after_inference_mode(case):
    opts = dict(MIXER_CASES[case])
    kind = opts.pop("kind", case)
    torch.manual_seed(0)
    mixer = build(kind, DIM, **opts).to(CUDA)
    x = torch.randn(2, N, DIM, device=CUDA)
    layout = TokenLayout(grid=GRID, num_prefix=0)
    check_eval_then_train(mixer, lambda m: m(x, layout), "inference_mode")


@pytest.mark.parametrize("name", ["deit_mini", "refiner_vit_mini", "aft_conv_mini"])
def test_compiled_training_step_on_cuda_matches_eager(name):
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10).train().double().to(CUDA)
    x = torch.randn(4, *model.meta["input_size"], dtype=torch.float64, device=CUDA)
    y = torch.randint(0, 10, (4,), device=CUDA)
    eager_loss, eager_grads = loss_and_grads(model, model, x, y)
    torch._dynamo.reset()
    compiled_loss, compiled_grads = loss_and_grads(model, torch.compile(model), x, y)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-4, atol=0)
    assert (compiled_grads - eager_grads).norm() <= 1e-4 * eager_grads.norm()


@pytest.mark.parametrize("name", TINY)
def test_decoding_on_cuda_equals_the_full_forward(name):
    torch.manual_seed(0)
    m = create_lm(name, max_len=40).to(CUDA).eval()
    randomise_biases(m)
    g = torch.Generator(device=CUDA).manual_seed(1)
    prompt = torch.randint(0, 256, (3, 6), device=CUDA)
    seq, logits = generate(m, 30, prompt=prompt, generator=g, return_logits=True)
    assert seq.device.type == "cuda" and seq.shape == (3, 36)
    with torch.no_grad():
        full = m(shift_right(seq, m.vocab_size))
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


def test_compiled_bf16_training_run_on_cuda(tmp_path):
    from test_device import TINY_RUN
    from vitlab.checkpoint import load_checkpoint
    from vitlab.cli import main as cli_main

    out = tmp_path / "run"
    argv = ["train", *TINY_RUN, "--epochs", "1", "--device", "cuda", "--amp", "bf16", "--compile", "--out", str(out)]
    assert cli_main(argv) == 0
    ckpt = load_checkpoint(out / "last.pt")
    assert ckpt["config"]["compile"] and all(torch.isfinite(t).all() for t in ckpt["model"].values())
