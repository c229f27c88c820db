"""AFT-full's channel-major inference (:func:`vitlab.ops.aft.aft_full_channels`): the paper's equation, equal to the
token-major core, taken exactly where it applies, and the exact repair of underflowed entries kept."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import pytest
import torch

from test_aft import FallbackCounter, assert_rel, naive_full
from vitlab import ops
from vitlab.mixers import AFTFull, AFTLocal, TokenLayout
from vitlab.mixers import aft as aft_mod
from vitlab.ops import aft as aft_ops
from vitlab.ops import probe
from vitlab.ops.switch import fast_paths


@pytest.fixture
def aten_products(monkeypatch):
    """The fast paths on, fp32 inference products on aten's BLAS and the channel-major layout taken, whatever the
    probe chose on this CPU (where oneDNN's products are taken or the token-major core is the faster, the
    channel-major path stands aside; tested below)."""
    from vitlab.ops import switch

    monkeypatch.setattr(switch, "_enabled", True)
    decision = probe.onednn_linear(torch.float32, False)
    monkeypatch.setitem(probe._DECISIONS, (torch.float32, False), replace(decision, taken=False))
    monkeypatch.setitem(probe._DECISIONS, probe._AFT, probe.Decision(True, True, reason="taken for the test"))


class ChannelMajorCounter:
    """Counts the calls of the channel-major core and how many returned None (an underflow, handed back)."""

    def __init__(self, monkeypatch):
        self.calls, self.declined = 0, 0
        original = aft_mod.aft_full_channels

        def counting(*args, **kwargs):
            out = original(*args, **kwargs)
            self.calls += 1
            self.declined += out is None
            return out

        monkeypatch.setattr(aft_mod, "aft_full_channels", counting)


def inputs(b=3, n=19, c=8, key_scale=1.0, bias_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, c, generator=g) * s for s in (1.0, key_scale, 1.0))
    return q, k, v, torch.randn(n, n, generator=g) * bias_scale


def as_channels(q, k, v):
    """``[Qᵀ; Kᵀ; Vᵀ]`` (3C, B·T): each channel's tokens in one row, batch-major, as W xᵀ lays them out."""
    return torch.cat([t.permute(2, 0, 1).reshape(t.shape[-1], -1) for t in (q, k, v)]).contiguous()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bias_scale", [1.0, 12.0], ids=["narrow", "wide"])
def test_the_core_is_the_paper_equation(causal, bias_scale):
    """Eq. 2 per output, float64 and term by term, against the core on channel rows; bias rows spanning more than
    the safe span (scale 12: ~60) take the check on the sums instead of the bound, and no entry underflows."""
    q, k, v, w = inputs(bias_scale=bias_scale)
    assert aft_ops._bias_bounds_sums(w, torch.empty(10**6), False) is (bias_scale == 1.0)
    b, n, c = q.shape
    y_t = aft_ops.aft_full_channels(as_channels(q, k, v), b, w, causal)
    assert y_t is not None and y_t.shape == (c, b * n)
    assert_rel(y_t.view(c, b, n).permute(1, 2, 0), naive_full(q, k, v, w, causal), 1e-5)


def test_the_core_hands_back_underflowed_sums():
    """Keys and biases of 1e4: shifted denominators underflow, the core returns None instead of a ratio."""
    q, k, v, w = inputs(key_scale=1e4, bias_scale=1e4, seed=2)
    assert aft_ops.aft_full_channels(as_channels(q, k, v), q.shape[0], w) is None


@pytest.mark.parametrize(
    ("w", "causal", "bounded"),
    [
        (torch.randn(9, 9), False, True),
        (torch.zeros(9, 9).index_put_((torch.tensor(3), torch.tensor(5)), torch.tensor(-39.9)), False, True),
        (torch.zeros(9, 9).index_put_((torch.tensor(3), torch.tensor(5)), torch.tensor(40.1)), False, False),
        (torch.randn(9, 9).fill_diagonal_(-math.inf), False, False),  # an excluded pair
        (torch.randn(9, 9).fill_diagonal_(math.nan), False, False),
        (torch.randn(9, 9), True, False),  # masked future pairs
    ],
    ids=["normal", "span-39.9", "span-40.1", "minus-inf", "nan", "causal"],
)
def test_the_bias_bounds_the_sums_only_when_every_row_is_narrow(w, causal, bounded):
    assert aft_ops._bias_bounds_sums(w, torch.empty(10**6), causal) is bounded


def test_the_bias_is_not_read_where_the_sums_are_fewer():
    """A bias with more elements than the sums: their own check is the cheaper, the bound is not asked."""
    assert not aft_ops._bias_bounds_sums(torch.randn(9, 9), torch.empty(80), False)


def test_the_bias_bound_skips_the_check_on_the_sums(monkeypatch):
    """Narrow biases: no reduction over the denominators at all, in either core."""
    q, k, v, w = inputs()
    seen = []
    original = torch.Tensor.amin
    monkeypatch.setattr(torch.Tensor, "amin", lambda t, *a, **kw: seen.append(t.shape) or original(t, *a, **kw))
    with torch.inference_mode():
        aft_ops.aft_full_channels(as_channels(q, k, v), q.shape[0], w)
        aft_ops.aft_full(q, k, v, w)
    assert seen == [(19, 19)] * 2  # the bias' rows, once per core; never the (B, T, C) sums


def test_linear_transposed_is_the_layer_transposed():
    torch.manual_seed(0)
    x = torch.randn(13, 6)
    for layer in (torch.nn.Linear(6, 5), torch.nn.Linear(6, 5, bias=False)):
        assert torch.allclose(aft_ops.linear_transposed(layer, x), layer(x).t(), atol=1e-6)


MIXERS = [
    (AFTFull, {"max_len": 21}),
    (AFTFull, {"max_len": 21, "bias_dim": None, "hidden_dim": 16}),
    (AFTFull, {"max_len": 21, "causal": True, "qkv_bias": False}),
    (AFTFull, {"max_len": 25, "resample": True}),  # 21 tokens: the bias resampled
    (AFTLocal, {"max_len": 21, "window": 30}),  # the window covers the sequence: the dense core
    (AFTLocal, {"max_len": 25, "window": 3, "resample": True, "outside": "-inf"}),  # resampled: dense
]


@pytest.mark.usefixtures("aten_products")
@pytest.mark.parametrize(("cls", "kw"), MIXERS, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_mixer_inference_takes_it_and_equals_the_token_major_core(cls, kw, monkeypatch):
    counter = ChannelMajorCounter(monkeypatch)
    torch.manual_seed(0)
    m = cls(24, **kw).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    x, layout = torch.randn(3, 21, 24), TokenLayout(grid=(4, 5), num_prefix=1)
    with torch.inference_mode():
        fast = m(x, layout)
    assert (counter.calls, counter.declined) == (1, 0)
    with fast_paths(False), torch.inference_mode():
        plain = m(x, layout)
    assert counter.calls == 1
    assert_rel(fast, plain, 1e-5)
    # and the paper's equation behind the projections
    qkv = m.qkv(x).double()
    q, k, v = qkv.chunk(3, -1)
    y = naive_full(q, k, v, m.position_bias(21, layout).double(), m.causal)
    assert_rel(fast, torch.nn.functional.linear(y, m.proj.weight.double(), m.proj.bias.double()), 1e-5)


@pytest.mark.usefixtures("aten_products")
def test_mixer_underflow_runs_the_token_major_core_and_its_exact_repair(monkeypatch):
    counter, fallback = ChannelMajorCounter(monkeypatch), FallbackCounter(monkeypatch)
    torch.manual_seed(2)
    m = AFTFull(8, max_len=12, bias_dim=None).eval()
    with torch.no_grad():
        m.qkv.weight.mul_(1e4)
        m.w.normal_(0, 1e4)
    x = torch.randn(2, 12, 8)
    with torch.inference_mode():
        out = m(x, TokenLayout())
    assert (counter.calls, counter.declined) == (1, 1) and fallback.entries > 0
    q, k, v = m.qkv(x).detach().double().chunk(3, -1)
    y = naive_full(q, k, v, m.w.detach().double())
    assert_rel(out, torch.nn.functional.linear(y, m.proj.weight.double(), m.proj.bias.double()), 1e-5)


@pytest.mark.usefixtures("aten_products")
def test_not_taken_where_it_does_not_apply(monkeypatch):
    """Training, aux outputs, AFT-local's band path, bf16, the switch off, a CPU where the probe found the
    token-major core faster and oneDNN's products keep the token-major core."""
    counter = ChannelMajorCounter(monkeypatch)
    x, layout = torch.randn(2, 21, 24), TokenLayout()
    full = AFTFull(24, max_len=21)
    full(x, layout).sum().backward()  # autograd records
    with torch.inference_mode():
        full(x, layout, return_aux=True)
        AFTLocal(24, max_len=21, window=3).eval()(x, layout)  # N > window: the band
        with torch.autocast("cpu", dtype=torch.bfloat16):
            full(x, layout)
        with fast_paths(False):
            full(x, layout)
    assert counter.calls == 0
    monkeypatch.setitem(probe._DECISIONS, probe._AFT, probe.Decision(True, False, reason="token-major faster"))
    with torch.inference_mode():
        full(x, layout)  # where the token-major core is the faster on this CPU
    assert counter.calls == 0
    monkeypatch.setitem(probe._DECISIONS, probe._AFT, probe.Decision(True, True, reason="channel-major faster"))
    decision = probe.onednn_linear(torch.float32, False)
    monkeypatch.setitem(probe._DECISIONS, (torch.float32, False), replace(decision, taken=True))
    if decision.works:
        with torch.inference_mode():
            full(x, layout)
        assert counter.calls == 0


def test_the_probe_takes_channel_major_where_it_is_faster(monkeypatch, tmp_path):
    """The layout is the faster of the two on this CPU (the median ratio of paired calls of the whole mixer's
    inference, both computing the same output), decided once, cached for the machine and reported; a path that
    fails or disagrees leaves the token-major core."""
    monkeypatch.setenv("VITLAB_CACHE_DIR", str(tmp_path))
    real_probe, real_time = probe._probe_aft, probe._time
    for ratio, taken in ((0.8, True), (0.99, True), (1.0, False), (1.17, False)):
        monkeypatch.setattr(probe, "_time", lambda fast, plain, r=ratio: (r * 10.0, 10.0, r))
        decision = real_probe()
        assert decision.works and decision.taken is taken and f"{ratio:.2f}x the token-major" in decision.reason

    outputs = []

    def timed_once(channel_major, token_major):
        outputs.extend([channel_major(), token_major()])
        return 8.0, 10.0, 0.8

    monkeypatch.setattr(probe, "_time", timed_once)
    monkeypatch.delitem(probe._DECISIONS, probe._AFT, raising=False)
    first = probe.aft_channel_major()
    assert first.taken and len(outputs) == 2 and torch.allclose(*outputs, rtol=1e-4, atol=1e-5)  # the same mixer
    monkeypatch.setattr(probe, "_time", real_time)  # the other decisions, reported below, are probed for real
    assert ops.decisions()["aft_full_channel_major[infer]"] == asdict(first)
    monkeypatch.setattr(probe, "_DECISIONS", {})
    monkeypatch.setattr(probe, "_probe_aft", lambda: pytest.fail("probed although the cache holds the answer"))
    assert probe.aft_channel_major() == first

    monkeypatch.setattr(probe, "aft_full_channels", lambda *a: None)  # sums that underflowed: no result
    failed = real_probe()
    assert not failed.works and not failed.taken and "no result" in failed.reason
    monkeypatch.setattr(
        probe, "aft_full_channels", lambda qkv_t, b, w: torch.zeros(qkv_t.shape[0] // 3, qkv_t.shape[1])
    )
    failed = real_probe()
    assert not failed.works and not failed.taken and "differs" in failed.reason
