"""The SAGAN-style GAN of External Attention's image-generation row: shapes, the hinge losses against their
formulas, the attention switch against direct implementations, a short training run with its checkpoint and
resume, and FID through torchmetrics with a small stand-in feature extractor (no Inception weights needed)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

from vitlab.cli import main as cli_main
from vitlab.tasks.gan import build_gan, d_hinge_loss, g_hinge_loss
from vitlab.tasks.gan.fid import MISSING, frechet_distance, inception_file
from vitlab.tasks.gan.inception import FIDInceptionV3, load_fid_inception
from vitlab.tasks.gan.model import GAN_SIZES, Attention2d

TINY = dict(z_dim=8, g_channels=16, d_channels=16)


@pytest.mark.parametrize("attention", ["sa", "ea", "none"])
@pytest.mark.parametrize(("img_size", "chans"), [(32, 3), (16, 1)])
def test_shapes(attention, img_size, chans):
    torch.manual_seed(0)
    g, d = build_gan("mini", img_size, chans, attention, **TINY)
    images = g(torch.randn(5, 8))
    assert images.shape == (5, chans, img_size, img_size) and images.abs().max() <= 1
    assert d(images).shape == (5,)
    kinds = [m.kind for m in (*g.modules(), *d.modules()) if isinstance(m, Attention2d)]
    assert kinds == [attention, attention]
    with pytest.raises(ValueError, match="power of two"):
        build_gan("mini", 24, 3, attention, **TINY)


def test_hinge_losses_are_their_formulas():
    real, fake = torch.tensor([2.0, 0.5, -1.0]), torch.tensor([-3.0, 0.0, 0.25])
    # D: mean(max(0, 1 - D(x))) + mean(max(0, 1 + D(G(z)))) = (0 + 0.5 + 2)/3 + (0 + 1 + 1.25)/3
    assert d_hinge_loss(real, fake).item() == pytest.approx(2.5 / 3 + 2.25 / 3)
    assert g_hinge_loss(fake).item() == pytest.approx(-(-3.0 + 0.0 + 0.25) / 3)  # -mean(D(G(z)))


def test_self_attention_is_sagans_equation():
    torch.manual_seed(0)
    block = Attention2d("sa", 16).eval()
    with torch.no_grad():
        block.gamma.fill_(0.7)
    x = torch.randn(2, 16, 4, 4)
    a = block.attn
    f, g, h = (m(x).flatten(2) for m in (a.f, a.g, a.h))
    out = torch.zeros(2, 8, 16)
    for i in range(16):  # o_i = Σ_j softmax_j(f_i · g_j) h_j
        weights = torch.softmax(torch.einsum("bc,bcj->bj", f[:, :, i], g), dim=1)
        out[:, :, i] = torch.einsum("bj,bcj->bc", weights, h)
    expected = x + 0.7 * a.out(out.view(2, 8, 4, 4))
    torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-5)


def test_external_attention_is_the_double_normalised_memory():
    torch.manual_seed(0)
    block = Attention2d("ea", 16, memory_size=8).eval()
    with torch.no_grad():
        block.gamma.fill_(0.5)
    x = torch.randn(2, 16, 4, 4)
    a = block.attn
    t = a.inp(x).flatten(2).transpose(1, 2)  # (B, N, C)
    logits = a.ea.mk(t)  # (B, N, S)
    alpha = logits.softmax(dim=1)  # over the positions
    alpha = alpha / (1e-9 + alpha.sum(dim=2, keepdim=True))  # ℓ1 over the slots
    o = a.ea.mv(alpha).transpose(1, 2).reshape(2, 16, 4, 4)
    torch.testing.assert_close(block(x), x + 0.5 * a.out(o), rtol=1e-5, atol=1e-5)


def test_the_switch_starts_as_the_plain_network_and_differs_once_gamma_moves():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 8, 8)
    for kind in ("sa", "ea"):
        block = Attention2d(kind, 16)
        assert torch.equal(block(x), x)  # γ = 0 at the start (SAGAN)
        with torch.no_grad():
            block.gamma.fill_(1.0)
        assert not torch.allclose(block(x), x)
    assert Attention2d("none", 16).gamma is None and not list(Attention2d("none", 16).parameters())
    with pytest.raises(ValueError, match="attention must be one of sa, ea, none"):
        Attention2d("mhsa", 16)


class StandIn(nn.Module):
    """A small fixed feature extractor (mean colour per quadrant): what FID's Inception is, for the plumbing."""

    num_features = 12

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.adaptive_avg_pool2d(x.float().expand(-1, 3, -1, -1), 2).flatten(1)


def test_fid_of_a_distribution_against_itself_is_zero_and_a_shift_is_its_square():
    pytest.importorskip("torchmetrics")
    torch.manual_seed(0)
    images = torch.rand(400, 3, 8, 8) * 0.5
    batches = list(images.split(100))
    assert frechet_distance(batches, batches, StandIn()) == pytest.approx(0, abs=1e-6)
    # equal covariances: FID = ‖μ_r − μ_g‖² = 12 features x 0.1²
    shifted = [b + 0.1 for b in batches]
    assert frechet_distance(batches, shifted, StandIn()) == pytest.approx(12 * 0.01, rel=1e-4)


def test_fid_says_in_one_line_that_the_weights_are_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("VITLAB_INCEPTION", raising=False)
    assert (
        MISSING == "FID needs the Inception weights file (pt_inception-2015-12-05-6726825d.pth); give --inception PATH"
    )
    with pytest.raises(FileNotFoundError) as e:
        inception_file(None)
    assert str(e.value) == MISSING
    assert cli_main(["gan", "fid", str(tmp_path / "last.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"vitlab gan fid: error: {MISSING}"
    monkeypatch.setenv("VITLAB_INCEPTION", str(tmp_path / "nothing.pth"))
    with pytest.raises(FileNotFoundError, match="is not a file"):
        inception_file(None)


def test_the_inception_loads_its_weights_file_and_refuses_others(tmp_path):
    model = FIDInceptionV3()
    assert sum(p.numel() for p in model.parameters()) == 23_850_960  # with the 1008-way fc of the file
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "w.pth")
    loaded = load_fid_inception(tmp_path / "w.pth")
    assert not loaded.training and loaded.train().training is False  # a fixed extractor
    del state["Mixed_7c.branch_pool.conv.weight"]
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="1 missing"):
        load_fid_inception(tmp_path / "bad.pth")


def test_the_inception_features_of_small_images():
    """Grey 28-px digits and 32-px colour images alike go in (resized to 299, one channel repeated): shapes only,
    on the meta device (a CPU forward of Inception-v3 costs seconds)."""
    with torch.device("meta"):
        model = FIDInceptionV3()
        for x in (torch.zeros(2, 1, 28, 28, dtype=torch.uint8), torch.zeros(3, 3, 32, 32)):
            assert model(x).shape == (len(x), 2048)


def test_train_checkpoint_resume_and_fid(tmp_path, monkeypatch):
    """Four steps on the embedded MNIST, resumed to six; the FID of the checkpoint with the stand-in."""
    from vitlab.tasks.gan.train import GANTrainConfig, checkpoint_fid, train_gan

    monkeypatch.setitem(GAN_SIZES, "mini", TINY)  # the mini row at test size
    out = tmp_path / "run"
    argv = ["gan", "train", "--attention", "ea", "--img-size", "16", "--batch-size", "8", "--out", str(out)]
    assert cli_main([*argv, "--steps", "4", "--checkpoint-every", "2", "--log-every", "2", "--threads", "1"]) == 0
    assert (out / "samples.png").read_bytes()[:4] == b"\x89PNG"
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4] and all(r["loss_d"] >= 0 for r in log)
    assert cli_main([*argv, "--steps", "6"]) == 2  # the folder holds a run: --resume or a new one
    cfg = GANTrainConfig(out=str(out), attention="ea", img_size=16, batch_size=8, steps=6, resume=True, threads=1)
    assert train_gan(cfg)["step"] == 6 and torch.load(out / "last.pt", weights_only=True)["step"] == 6
    if importlib.util.find_spec("torchmetrics"):  # the FID plumbing of a checkpoint (its own test skips without)
        result = checkpoint_fid(out / "last.pt", samples=32, batch_size=16, device="cpu", feature=StandIn())
        assert result["fid"] >= 0 and result["generated"] == 32 and result["attention"] == "ea"
