"""AFT against the community implementations' golden vectors (``aft_*.npz``, see docs/testing.md).

No official AFT code exists; these references compute the paper's equations for full, simple and local
(docs/testing.md). Their parameter names are mapped to ours here. AFT-conv has no trustworthy
reference (test_aft.py checks it against the paper's Eq. 6 directly).
"""

from __future__ import annotations

import torch
from torch import nn

from conftest import assert_close_to_golden, load_golden
from vitlab.mixers import AFTFull, AFTLocal, AFTSimple


def load_qkv(m, g, names, bias=True):
    """Fuse the reference's three Q/K/V Linears into our ``qkv``."""
    with torch.no_grad():
        m.qkv.weight.copy_(torch.cat([g.param(f"{n}.weight") for n in names]))
        if bias:
            m.qkv.bias.copy_(torch.cat([g.param(f"{n}.bias") for n in names]))


def load_proj(m, g, name):
    with torch.no_grad():
        m.proj.weight.copy_(g.param(f"{name}.weight"))
        m.proj.bias.copy_(g.param(f"{name}.bias"))


def test_aft_full_xmu():
    g = load_golden("aft_full_xmu.npz")
    m = AFTFull(32, max_len=16, bias_dim=None)
    load_qkv(m, g, ["fc_q", "fc_k", "fc_v"])
    m.proj = nn.Identity()  # xmu's AFT_FULL has no output projection
    with torch.no_grad():
        m.w.copy_(g.param("position_biases"))
    assert_close_to_golden(m(g.input("x")), g.output("x"))


def test_aft_simple_xmu():
    g = load_golden("aft_simple_xmu.npz")
    m = AFTSimple(32)
    load_qkv(m, g, ["fc_q", "fc_k", "fc_v"])
    m.proj = nn.Identity()
    assert_close_to_golden(m(g.input("x")), g.output("x"))


def test_aft_full_rish():
    # rish builds wbias for max_seqlen = 20 and uses its top-left [:T, :T] block for T = 16 tokens; a
    # non-causal vitlab AFT-full is built for its token count, so it gets that block as its table.
    g = load_golden("aft_full_rish.npz")
    m = AFTFull(32, max_len=16, hidden_dim=24, bias_dim=None)
    load_qkv(m, g, ["to_q", "to_k", "to_v"])
    load_proj(m, g, "project")
    with torch.no_grad():
        m.w.copy_(g.param("wbias")[:16, :16])
    assert_close_to_golden(m(g.input("x")), g.output("x"))


def test_aft_simple_rish():
    g = load_golden("aft_simple_rish.npz")
    m = AFTSimple(32, hidden_dim=24)
    load_qkv(m, g, ["to_q", "to_k", "to_v"])
    load_proj(m, g, "project")
    assert_close_to_golden(m(g.input("x")), g.output("x"))


def test_aft_local_rish():
    # the window mask depends on |t - t'| only, so masking the 20 x 20 table then slicing (rish) equals
    # slicing then masking (ours)
    g = load_golden("aft_local_rish.npz")
    m = AFTLocal(32, max_len=16, window=4, hidden_dim=24, bias_dim=None)
    load_qkv(m, g, ["to_q", "to_k", "to_v"])
    load_proj(m, g, "project")
    with torch.no_grad():
        m.w.copy_(g.param("wbias")[:16, :16])
    assert_close_to_golden(m(g.input("x")), g.output("x"))


def test_aft_full_factorized_comvex():
    g = load_golden("aft_full_factorized_comvex.npz")
    m = AFTFull(32, max_len=16, hidden_dim=24, bias_dim=8, qkv_bias=False)
    load_qkv(m, g, ["Q", "K", "V"], bias=False)
    load_proj(m, g, "out_linear")
    with torch.no_grad():
        m.u.copy_(g.param("u"))
        m.v.copy_(g.param("v"))
    assert_close_to_golden(m.position_bias(), g.output("position_bias"))
    assert_close_to_golden(m(g.input("x")), g.output("x"))
