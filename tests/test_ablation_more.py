"""CPVT's learned position table before every block and the AFT appendix's sparser biases (AFT-conv's sparsity
penalty, one context point per head), each against a direct float64 implementation."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from test_aft import naive_conv_paper
from vitlab.common.distributed import World
from vitlab.engine.config import TrainConfig, TrainingError
from vitlab.engine.loop import forward_backward
from vitlab.engine.setup import setup
from vitlab.mixers import AFTConv, TokenLayout
from vitlab.models import VisionTransformer, build_model


def small_vit(**kw) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=8, patch_size=4, embed_dim=8, depth=3, num_heads=2, num_classes=3, **kw)
    return model.double().eval()


def test_position_table_before_every_block_is_added_to_each_blocks_input():
    model = small_vit(pos_embed_every_block=True)
    assert sorted(model.block_pos_embed) == ["1", "2"]  # block 0's table is pos_embed
    assert all(t.abs().sum() > 0 for t in model.block_pos_embed.values())  # trunc-normal, not zeros
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    # direct: x_0 = [cls | patches] + P_0 ; x_{j+1} = Block_j(x_j) + P_{j+1} ; logits = head(norm(x_L)[:, 0])
    patches = F.conv2d(x, model.patch_embed.proj.weight, model.patch_embed.proj.bias, stride=4)
    tokens = torch.cat([model.cls_token.expand(2, -1, -1), patches.flatten(2).transpose(1, 2)], 1) + model.pos_embed
    layout = TokenLayout((2, 2), 1)
    for j, block in enumerate(model.blocks):
        if j > 0:
            tokens = tokens + model.block_pos_embed[str(j)]
        tokens = block(tokens, layout)
    expected = model.head(model.norm(tokens)[:, 0])
    torch.testing.assert_close(model(x), expected, rtol=1e-10, atol=1e-10)
    plain = small_vit()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "block_pos_embed" not in k})
    assert not torch.allclose(plain(x), model(x))  # the tables change the output


def test_position_tables_before_every_block_learn_with_their_block_and_follow_the_input_size():
    model = small_vit(pos_embed_every_block=True)
    assert {"block_pos_embed.1", "block_pos_embed.2"} <= model.no_weight_decay()
    assert (r"^block_pos_embed\.(\d+)$", None) in model.group_matcher()["blocks"]
    model.set_input_size(16)
    assert all(t.shape == (1, 17, 8) for t in model.block_pos_embed.values())
    assert model(torch.randn(1, 3, 16, 16, dtype=torch.float64)).shape == (1, 3)
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    before = model.forward_intermediates(x, indices=[0], intermediates_only=True)[0]
    model.prune_intermediate_layers(indices=[0])  # block 0 stays, with the table its output carries to block 1
    assert sorted(model.block_pos_embed) == ["1"]
    assert torch.equal(model.forward_intermediates(x, indices=[0], intermediates_only=True)[0], before)
    with pytest.raises(ValueError, match="pos_embed='learned'"):
        small_vit(pos_embed_every_block=True, pos_embed="none")


def conv_mixer(**kw) -> AFTConv:
    torch.manual_seed(0)
    return AFTConv(8, num_heads=4, kernel_size=3, **kw).double()


def test_sparsity_penalty_is_the_mean_absolute_relative_weight():
    m = conv_mixer(sparsity=0.3)
    with torch.no_grad():
        m.gamma.normal_(0, 1.0)
        m.beta.normal_(0, 0.5)
    w, gamma, beta = m.w.detach(), m.gamma.detach(), m.beta.detach()
    total = 0.0
    for i in range(4):  # Eq. 8 per head, then the penalty's sum of |e^w - 1| over the 3 x 3 entries
        mean = w[i].mean()
        std = ((w[i] - mean) ** 2).mean().add(m.eps).sqrt()
        wi = gamma[i] * (w[i] - mean) / std + beta[i]
        total += sum(abs(torch.exp(wi[a, b]).item() - 1) for a in range(3) for b in range(3))
    assert m.regularization_loss().item() == pytest.approx(0.3 * total / 36, rel=1e-6)
    assert conv_mixer().regularization_loss() is None
    with pytest.raises(ValueError, match="sparsity"):
        conv_mixer(sparsity=-1.0)


def test_one_point_per_head_is_a_single_weighted_offset():
    m = conv_mixer(one_point=True)
    assert m.w.shape == (4,) and m.gamma is None and not m.reparam
    with torch.no_grad():
        m.w.copy_(torch.tensor([0.5, -1.0, 2.0, 0.3]))
    kernel = m.effective_kernel()
    for i in range(4):  # head i: e^{w_i} - 1 at offset i (row-major in the 3 x 3 window), 0 elsewhere
        expected = torch.zeros(3, 3, dtype=torch.float64)
        expected.view(-1)[i] = torch.expm1(m.w[i].detach())
        torch.testing.assert_close(kernel[i].double(), expected)
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    layout = TokenLayout((3, 3), 1)
    q, k, v = m.qkv(x).split([8, 4, 8], -1)
    direct = naive_conv_paper(q, k, v, m.position_bias().detach(), (3, 3), 1)
    torch.testing.assert_close(m.mix(x, layout, None, False)[0], m.proj(direct), rtol=1e-5, atol=1e-6)  # fp32 core


def penalised_config(tmp_path, **kw) -> TrainConfig:
    return TrainConfig(model="aft_conv_sparse_mini", data="mnist", train_limit=4, holdout=2, batch_size=2,
                       img_size=28, threads=1, device="cpu", out=str(tmp_path), progress=False, **kw)  # fmt: skip


def test_training_adds_the_models_penalty_to_the_loss(tmp_path):
    run = setup(penalised_config(tmp_path), lambda line: None, World(), torch.device("cpu"), time.perf_counter())
    try:
        with torch.no_grad():  # move the bias off 0, where the penalty is 0
            for blk in run.net.raw.blocks:
                blk.mixer.gamma.fill_(1.0)
                blk.mixer.beta.fill_(0.5)
        run.data.loader.set_epoch(0)
        batch = next(iter(run.data.loader))
        loss, _ = forward_backward(run, batch, 1.0, True)
        plain = run.net.criterion(batch[0], run.net.model(batch[0]), batch[1], None)
        penalty = run.net.raw.regularization_loss()
        assert penalty.item() > 0
        assert loss.item() == pytest.approx((plain + penalty).item(), rel=1e-5)
    finally:
        run.steps.close()


def test_the_penalty_refuses_fsdp_with_one_line(tmp_path):
    with pytest.raises(TrainingError, match="drop --fsdp"):
        setup(penalised_config(tmp_path, fsdp=True), lambda line: None, World(), torch.device("cpu"), 0.0)


def test_named_rows_build():
    for name in ("deit_pe_every_block_mini", "aft_conv_sparse_mini", "aft_conv_one_point_mini"):
        assert build_model(name)(torch.randn(1, 3, 32, 32)).shape == (1, 1000)
