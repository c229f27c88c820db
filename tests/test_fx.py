"""torch.fx: one model of every family traces with ``torch.fx.symbolic_trace`` into a GraphModule that
computes what the model computes, keeps the input checks, and trains (gradients equal to the model's).

torchvision's ``create_feature_extractor`` (the same tracer over named nodes) is exercised by
``scripts/timm_battery.sh`` (torchvision does not install beside this project's torch).
"""

from __future__ import annotations

import pytest
import torch

import vitlab

#: one model of each family (mixers and embeddings): ViT/DeiT, Refined-ViT, DeepViT, CPVT, PCPVT, TNT, T2T
#: (EAMLP), AFT-full, AFT-local, AFT-simple, AFT-conv
FAMILIES = [
    "deit_mini",
    "refiner_vit_mini",
    "deepvit_mini",
    "cpvt_mini",
    "pcpvt_mini",
    "tnt_mini",
    "t2t_vit_mini",
    "eamlp_mini",
    "aft_full_mini",
    "aft_local_w4_mini",
    "aft_simple_mini",
    "aft_conv_mini",
]


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return vitlab.create_model(name, num_classes=5)


@pytest.mark.parametrize("name", FAMILIES)
def test_symbolic_trace_computes_the_model(name):
    model = build(name).eval()
    graph = torch.fx.symbolic_trace(model)
    assert isinstance(graph, torch.fx.GraphModule)
    x = torch.randn(2, *model.pretrained_cfg["input_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(graph(x), model(x), rtol=1e-5, atol=1e-5)
    called = {n.target.__name__ for n in graph.graph.nodes if n.op == "call_function" and callable(n.target)}
    assert "check_image" in called  # the graph checks each image it gets
    wrong = torch.randn(2, model.in_chans + 1, *model.pretrained_cfg["input_size"][1:])
    with pytest.raises(ValueError, match="expected images of shape"):
        graph(wrong)


@pytest.mark.parametrize("name", ["tnt_mini", "deit_mini"])
def test_fixed_size_model_traces_into_a_graph_for_its_size(name):
    """A model with a position table traces into a graph for its own size (sizes are symbols while tracing);
    other sizes are refused by the graph in one line."""
    model = build(name).eval()
    graph = torch.fx.symbolic_trace(model)
    c, h, w = model.pretrained_cfg["input_size"]
    with pytest.raises(ValueError, match=rf"expected images of shape \(B, {c}, {h}, {w}\)"):
        graph(torch.randn(1, c, 2 * h, 2 * w))


@pytest.mark.parametrize("name", ["cpvt_mini", "aft_conv_mini"])
def test_any_size_model_traces_into_a_graph_of_any_size(name):
    """A model whose computation depends on the size only through reshapes (CPVT's PEGs, AFT-conv) traces into
    a graph that reads each input's size: it computes the model at other sizes, non-square ones included, and
    refuses a size that is no multiple of the patch in one line."""
    model = build(name).eval()
    assert model.pretrained_cfg["fixed_input_size"] is False
    graph = torch.fx.symbolic_trace(model)
    c, h, w = model.pretrained_cfg["input_size"]
    p = model.patch_embed.patch_size[0]
    for size in [(h, w), (2 * h, w), (h + 2 * p, w + p)]:
        x = torch.randn(2, c, *size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(graph(x), model(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="is not divisible by the patch size"):
        graph(torch.randn(1, c, h + 1, w))


@pytest.mark.parametrize("name", ["refiner_vit_mini", "tnt_mini", "aft_full_mini"])
def test_traced_graph_trains_as_the_model(name):
    model = build(name).double().train()
    graph = torch.fx.symbolic_trace(model)
    x = torch.randn(2, *model.pretrained_cfg["input_size"], dtype=torch.float64)
    grads = []
    for module in (model, graph):
        module.zero_grad()
        torch.manual_seed(3)
        module(x).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("name", vitlab.list_models("*_mini"))
def test_every_small_model_traces(name):
    model = build(name).eval()
    graph = torch.fx.symbolic_trace(model)
    c, h, w = model.pretrained_cfg["input_size"]
    sizes = [(h, w)] if model.pretrained_cfg["fixed_input_size"] else [(h, w), (h + 32, w + 64)]
    for size in sizes:  # (every model's patch or stage stride divides 32)
        x = torch.randn(2, c, *size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(graph(x), model(x), rtol=1e-5, atol=1e-5)
