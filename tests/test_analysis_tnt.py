"""TNT's analyses (feature maps, t-SNE of the feature maps, pixel-level attention) against naive loops over the
model's trace, and the exact t-SNE against its definitions (perplexity, the KL gradient) and on separable
clusters."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from test_analysis import main
from vitlab.analysis import analyze, parse_what
from vitlab.analysis.tnt import word_image
from vitlab.analysis.tsne import conditional_probabilities, joint_probabilities, kl_gradient, tsne
from vitlab.models import build_model

# ------------------------------------------------------------------------------------------ t-SNE


def clusters(per: int = 30, dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, dim, generator=gen, dtype=torch.float64) * 10
    x = torch.cat([c + torch.randn(per, dim, generator=gen, dtype=torch.float64) for c in centres])
    return x, torch.arange(3).repeat_interleave(per)


def test_tsne_input_similarities_have_the_asked_perplexity():
    x, _ = clusters()
    p = conditional_probabilities(x, 12.0)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(1)  # nats, p_{i|i} = 0
    torch.testing.assert_close(entropy, torch.full_like(entropy, math.log(12.0)), rtol=0, atol=1e-9)
    torch.testing.assert_close(p.sum(1), torch.ones(90, dtype=torch.float64))
    assert p.diagonal().abs().max() == 0
    # row i is a Gaussian kernel of the squared distances: log p_{j|i} - log p_{k|i} is linear in them
    d = torch.cdist(x, x) ** 2
    beta = (p[0, 1].log() - p[0, 2].log()) / (d[0, 2] - d[0, 1])
    torch.testing.assert_close(p[0, 3].log() - p[0, 1].log(), -beta * (d[0, 3] - d[0, 1]))


def test_tsne_gradient_is_the_gradient_of_the_kl_divergence():
    x, _ = clusters(per=10)
    p = joint_probabilities(x, 5.0)
    y = torch.randn(30, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    off = ~torch.eye(30, dtype=torch.bool)
    w = torch.where(off, 1 / (1 + ((y[:, None] - y[None]) ** 2).sum(-1)), 0.0)  # Student-t, one degree of freedom
    q = w / w.sum()
    pairs = off & (p > 0)  # 0 log 0 = 0: far clusters' pairs underflow to p = 0
    kl = (p[pairs] * (p[pairs] / q[pairs]).log()).sum()
    kl.backward()
    got_kl, got_grad = kl_gradient(p, y.detach())
    assert got_kl.item() == pytest.approx(kl.item(), rel=1e-12)
    torch.testing.assert_close(got_grad, y.grad, rtol=1e-9, atol=1e-12)


def test_tsne_separates_separable_clusters():
    x, labels = clusters(per=20)
    y, kl = tsne(x, 10.0, steps=400, exaggerated_steps=100)
    d = torch.cdist(y, y).fill_diagonal_(math.inf)
    assert (labels[d.argmin(1)] == labels).all()  # every point's nearest neighbour is in its cluster
    centres = torch.stack([y[labels == k].mean(0) for k in range(3)])
    radius = max((y[labels == k] - centres[k]).norm(dim=1).max().item() for k in range(3))
    assert torch.pdist(centres).min() > 2 * radius and 0 < kl < 1
    assert torch.equal(tsne(x, 10.0, steps=20)[0], tsne(x, 10.0, steps=20)[0])  # deterministic for a seed
    with pytest.raises(ValueError, match="perplexity"):
        tsne(x[:5], 10.0)


# ------------------------------------------------------------------------------------ the analyses


def test_word_image_places_each_word_at_its_pixel():
    words = torch.randn(2 * 6, 4, 3)  # 2 images, a 2x3 grid of patches, 2x2 words of 3 channels
    img = word_image(words, (2, 3), (2, 2))
    assert img.shape == (2, 3, 4, 6)
    for b in range(2):
        for i in range(2):
            for j in range(3):
                for r in range(2):
                    for c in range(2):
                        torch.testing.assert_close(img[b, :, i * 2 + r, j * 2 + c], words[b * 6 + i * 3 + j, r * 2 + c])
    with pytest.raises(ValueError, match="word_image"):
        word_image(words, (5, 5), (2, 2))


@pytest.fixture(scope="module")
def tnt_run(tmp_path_factory):
    torch.manual_seed(0)
    model = build_model("tnt_mini", num_classes=3).eval()
    x = torch.rand(3, 3, 32, 32)
    out = tmp_path_factory.mktemp("tnt")
    analyze(model, x, x, parse_what("tnt"), out, batch_size=2, log=lambda line: None)
    with torch.no_grad():
        trace = model.forward_trace(x, return_aux=True)
    return model, trace, {n: json.loads((out / f"{n}.json").read_text()) for n in parse_what("tnt")}, out


def test_tnt_feature_maps_are_the_tokens_and_the_word_means(tnt_run):
    model, trace, results, out = tnt_run
    feats = results["tnt_features"]
    (gh, gw), (mh, mw) = trace["layout"].grid, model.pixel_embed.word_grid
    outer, inner = np.array(feats["outer"]), np.array(feats["inner"])
    assert outer.shape == (3, 4, 12, gh, gw) and inner.shape == (3, 4, gh * mh, gw * mw)
    for blk in (0, 3):
        tokens, words = trace["tokens"][blk], trace["inner_tokens"][blk]
        for k, ch in enumerate(feats["channels"]):
            assert outer[2, blk, k, 1, 2] == pytest.approx(tokens[2, 1 + 1 * gw + 2, ch].item(), rel=1e-5)
        patch = 2 * gh * gw + 3 * gw + 1  # image 2, patch (3, 1), word (1, 0)
        want = words[patch, 1 * mw + 0].mean().item()
        assert inner[2, blk, 3 * mh + 1, 1 * mw + 0] == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert (out / "tnt_features.png").stat().st_size > 1000


def test_tnt_pixel_attention_is_the_centre_words_inner_attention(tnt_run):
    model, trace, results, _ = tnt_run
    att = results["tnt_inner_attention"]
    (gh, gw), (mh, mw) = trace["layout"].grid, model.pixel_embed.word_grid
    q = (mh // 2) * mw + mw // 2
    assert att["query_word"] == [mh // 2, mw // 2] and att["blocks"] == [0, 1, 2, 3]
    maps = np.array(att["maps"])  # [image][block][head][H][W]
    inner = trace["aux"][1]["inner_attn"]  # (B·n, heads, m, m)
    for i, j, r, c in ((0, 0, 0, 0), (2, 5, 1, 0), (7, 7, 1, 1)):
        want = inner[1 * gh * gw + i * gw + j, :, q, r * mw + c]
        np.testing.assert_allclose(maps[1, 1, :, i * mh + r, j * mw + c], want.numpy(), rtol=1e-5)
    # each patch's block of the map is one softmax row: it sums to 1
    np.testing.assert_allclose(maps[0, 0, 0, :mh, :mw].sum(), 1.0, rtol=1e-5)


def test_tnt_tsne_embeds_one_point_per_channel(tnt_run):
    model, _, results, out = tnt_run
    result = results["tnt_tsne"]
    assert np.array(result["points"]).shape == (model.embed_dim, 2) and result["block"] == len(model.blocks) - 1
    assert math.isfinite(result["kl_divergence"]) and (out / "tnt_tsne.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def deit_run(tmp_path_factory):
    torch.manual_seed(0)
    model = build_model("deit_mini", num_classes=3).eval()
    x = torch.rand(3, 3, 32, 32)
    out = tmp_path_factory.mktemp("deit")
    analyze(model, x, x, parse_what("tnt"), out, batch_size=2, log=lambda line: None)
    with torch.no_grad():
        trace = model.forward_trace(x, return_aux=True)
    summary = json.loads((out / "summary.json").read_text())
    return (
        model,
        trace,
        {n: json.loads((out / f"{n}.json").read_text()) for n in ("tnt_features", "tnt_tsne")},
        out,
        summary,
    )


def test_deit_feature_maps_are_its_patch_tokens_on_the_grid(deit_run):
    """DeiT's half of TNT's feature-map figure: the patch tokens reshaped over the grid, no pixel embeddings."""
    model, trace, results, out, summary = deit_run
    feats = results["tnt_features"]
    (gh, gw), prefix = trace["layout"].grid, trace["layout"].num_prefix
    outer = np.array(feats["outer"])  # [image][block][channel][row][column]
    assert outer.shape == (3, len(model.blocks), len(feats["channels"]), gh, gw)
    assert feats["inner"] is None and feats["word_grid"] is None and "no inner words" in feats["pixel_embeddings"]
    for blk in range(len(model.blocks)):
        tokens = trace["tokens"][blk]
        for img in range(3):
            for k, ch in enumerate(feats["channels"]):
                for r in range(gh):
                    for c in range(gw):
                        want = tokens[img, prefix + r * gw + c, ch].item()
                        assert outer[img, blk, k, r, c] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert (out / "tnt_features.png").stat().st_size > 1000
    assert "no pixel embeddings" in summary["analyses"]["tnt_features"]["summary"]
    assert "not a TNT model" in summary["analyses"]["tnt_inner_attention"]["skipped"]


def test_deit_tsne_embeds_one_point_per_channel_of_its_last_block(deit_run):
    model, _, results, out, _ = deit_run
    result = results["tnt_tsne"]
    assert np.array(result["points"]).shape == (model.embed_dim, 2) and result["block"] == len(model.blocks) - 1
    assert math.isfinite(result["kl_divergence"]) and (out / "tnt_tsne.png").stat().st_size > 1000


def test_cli_tnt_group_on_deit_and_tnt(tmp_path, capsys):
    out = tmp_path / "an"
    assert main(["analyze", "deit_mini", "--num-images", "2", "--what", "tnt_features", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "skipped" not in summary["analyses"]["tnt_features"]
    assert np.array(json.loads((out / "tnt_features.json").read_text())["outer"]).shape[:2] == (2, 4)
    assert main(["analyze", "tnt_mini", "--num-images", "2", "--what", "tnt_inner_attention", "--out", str(out)]) == 0
    assert "tnt_inner_attention" in capsys.readouterr().out
    assert main(["analyze", "resnet_mini", "--num-images", "2", "--what", "tnt_features", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "not one patch grid of one width" in summary["analyses"]["tnt_features"]["skipped"]
