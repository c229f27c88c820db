"""``torch.compile``: no graph break inside the block loop of any mixer, and compiled training equal to eager.

Graph breaks are listed with ``torch._dynamo.explain`` (tracing only, a few seconds): one model holding one
block of every token mixer covers the whole block loop in the default suite; the other architectures (TNT's
inner/outer blocks, T2T's token layers) are traced in the slow suite. Compiling with inductor takes tens of
seconds per model on two CPU cores, so the comparisons with eager are slow tests.

Tolerances: inductor fuses and reorders reductions, so compiled values differ from eager ones by a few units
in the last place per reduction. The comparisons run in float64, so that no division amplifies those units
into visible differences (DeepViT's re-attention BatchNorms maps of batch variance ~1e-4: in float32 the
compiled and eager outputs differ by 1e-3 relative there); AFT's cores compute in float32 whatever the
model's dtype, so ~1e-7 remains: relative 1e-4 on the loss and on the gradients (in norm) is far above that
and far below what a wrong graph gives.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vitlab
from vitlab.mixers import TokenLayout
from vitlab.mixers.aft import AFTLocal
from vitlab.models import VisionTransformer

# one block of every mixer, CPVT's PEG after the first, stochastic depth on: the whole block loop
EVERY_MIXER = [
    "attention",
    "aft_full",
    ("aft_local", {"window": 8}),  # 65 tokens > window: the banded path
    ("aft_conv", {"num_heads": 4, "kernel_size": 3}),
    "aft_simple",
    "external_mh",
    ("external", {"num_heads": 1}),
    "refiner",
    "reattention",
]
FAMILIES = ["deit_mini", "tnt_mini", "eamlp_mini", "refiner_vit_mini", "deepvit_mini", "cpvt_mini", "aft_conv_mini"]


def every_mixer_model() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(
        img_size=32, patch_size=4, embed_dim=32, depth=len(EVERY_MIXER), num_heads=4, num_classes=10,
        mixer=EVERY_MIXER, peg_at=(0,), drop_path_rate=0.1,
    )  # fmt: skip


def graph_breaks(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """Every graph break of a training-mode forward, as 'reason (at file:line, ...)'."""
    torch._dynamo.reset()
    report = torch._dynamo.explain(model.train())(x)
    return [
        f"{b.reason.splitlines()[0][:160]} (at {', '.join(f'{f.filename}:{f.lineno}' for f in b.user_stack[-3:])})"
        for b in report.break_reasons
    ]


def test_no_graph_break_in_any_mixer_block():
    breaks = graph_breaks(every_mixer_model(), torch.randn(2, 3, 32, 32))
    assert not breaks, "graph breaks:\n" + "\n".join(breaks)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tnt_mini", "eamlp_mini", "aft_full_mini", "aft_conv_mini"])
def test_no_graph_break_in_the_other_architectures(name):
    model = vitlab.create_model(name, num_classes=10)
    breaks = graph_breaks(model, torch.randn(2, *model.meta["input_size"]))
    assert not breaks, "graph breaks:\n" + "\n".join(breaks)


def loss_and_grads(model: torch.nn.Module, fn, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(fn(x), y)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_training_step_matches_eager(name):
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10).train().double()  # dropout-free configs: one function
    x, y = torch.randn(4, *model.meta["input_size"], dtype=torch.float64), torch.randint(0, 10, (4,))
    eager_loss, eager_grads = loss_and_grads(model, model, x, y)
    compiled_loss, compiled_grads = loss_and_grads(model, torch.compile(model), x, y)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-4, atol=0)
    assert (compiled_grads - eager_grads).norm() <= 1e-4 * eager_grads.norm()


@pytest.mark.slow
def test_compiled_aft_repairs_underflowed_outputs_exactly():
    """Keys of magnitude ~1e3 in causal AFT-local: about half of the outputs underflow and are recomputed;
    compiled, the repair (fixed slots, no branch) gives eager's outputs; traced without inductor, also its
    gradients exactly (inductor's own fp32 rounding is then amplified by the extreme keys)."""
    torch.manual_seed(0)
    m = AFTLocal(16, 40, window=4, causal=True)
    with torch.no_grad():
        m.qkv.weight.mul_(1e3)
    x = torch.randn(2, 40, 16)
    layout = TokenLayout.sequence()
    eager = m(x, layout)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(m)(x, layout), eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())
    grads = []
    for fn in (m, torch.compile(m, backend="aot_eager")):
        xx = x.clone().requires_grad_(True)
        fn(xx, layout).sum().backward()
        grads.append(xx.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.slow
def test_train_with_compile_and_resume(tmp_path):
    from vitlab.checkpoint import load_checkpoint
    from vitlab.cli import main as cli_main

    args = ["train", "--model", "deit_mini", "--model-arg", "patch_size=7", "--model-arg", "depth=1"]
    args += ["--model-arg", "embed_dim=32", "--train-limit", "64", "--holdout", "100", "--batch-size", "16"]
    args += ["--threads", "1", "--no-progress", "--epochs", "1", "--drop-path", "0", "--crop-padding", "0"]
    assert cli_main([*args, "--out", str(tmp_path / "eager")]) == 0
    assert cli_main([*args, "--compile", "--out", str(tmp_path / "compiled")]) == 0
    a, b = (load_checkpoint(tmp_path / n / "last.pt")["model"] for n in ("eager", "compiled"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 2e-5  # 4 AdamW steps at lr 1e-3, as DDP
