"""AFT Table 7's comparison models: ResNet-50 (as a model and a distillation teacher) and the lambda networks."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.models.resnet import resnet50


def test_resnet50_has_the_papers_size_and_torchvisions_names():
    with torch.device("meta"):
        model = resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # AFT Table 7: 25.6M
    keys = model.state_dict().keys()
    assert {"conv1.weight", "bn1.running_mean", "layer1.0.downsample.0.weight", "layer4.2.conv3.weight"} <= keys
    assert "layer1.1.downsample.0.weight" not in keys and "fc.bias" in keys
    with pytest.raises(ValueError, match="num_classes"):
        resnet50(num_classes=0)


def test_resnet50_trains():
    torch.manual_seed(0)
    model = resnet50(num_classes=5, in_chans=1)
    x = torch.randn(2, 1, 32, 32)
    assert model(x).shape == (2, 5)
    model(x).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_resnet50_teaches_as_torchscript(tmp_path):
    from vitlab.distill.teacher import load_teacher

    torch.manual_seed(0)
    model = resnet50(num_classes=5, in_chans=1).eval()
    x = torch.randn(2, 1, 32, 32)
    path = tmp_path / "resnet50.ts"
    torch.jit.script(model).save(str(path))
    teacher = load_teacher(path)
    with torch.no_grad():
        torch.testing.assert_close(teacher(x), model(x))


def test_lambda_rows():
    with torch.device("meta"):
        tiny = vitlab.create_model("lambda_tiny")
    mixer = tiny.blocks[0].mixer
    assert type(mixer).__name__ == "LambdaLayer" and mixer.key_dim == 16 and mixer.num_heads == 3
    assert tiny.pretrained_cfg["top1"] == 72.4 and tiny.pos_embed.shape == (1, 196, 192)  # no class token
    model = vitlab.create_model("lambda_mini", num_classes=3)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    with pytest.raises(ValueError, match="prefix_embedding"):
        vitlab.create_model("lambda_mini", class_token=True, global_pool="token")(torch.randn(1, 3, 32, 32))
