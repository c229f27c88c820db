"""The one-token decoding step of causal AFT on Triton (vitlab.ops.triton_aft_decode): every position equal to the
paper's equation in float64 (the full causal forward), to the plain step with the switch off, for keys and biases
of magnitude 1e4 and for keys that keep rising (the cache's reference raised and its terms rescaled).

Runs on CUDA, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported: the
step of ``scripts/test.sh``); elsewhere it skips (tests/test_triton_aft.py explains why).
"""

from __future__ import annotations

import os

import pytest
import torch

from test_aft import naive_full
from vitlab.ops import aft_decode as aft_ops
from vitlab.ops import fast_paths

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    not (CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton's interpreter is off in this process: run with TRITON_INTERPRET=1",
)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The number of kernel steps taken (the kernel module's entry points counted)."""
    from vitlab.ops import triton_aft_decode

    calls = []
    for name in ("running_step", "prefix_step"):
        original = getattr(triton_aft_decode, name)
        monkeypatch.setattr(triton_aft_decode, name, lambda *a, _f=original: calls.append(1) or _f(*a))
    return calls


def decode(state, q, k, v):
    """Every position's output from one state, a token at a time."""
    return torch.stack([state.advance(q[:, t], k[:, t], v[:, t], t) for t in range(k.shape[1])], 1)


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    return ((actual.double().cpu() - expected).norm() / expected.norm()).item()


def inputs(key_scale: float, rising: bool, b=2, n=21, c=12, seed=0):
    torch.manual_seed(seed)
    q, k, v = (torch.randn(b, n, c) for _ in range(3))
    k = k * key_scale + (torch.linspace(0, 150, n)[:, None] if rising else 0)  # rising: the reference is raised
    return q, k, v


@pytest.mark.parametrize("key_scale, rising", [(1.0, False), (1.0, True), (1e4, False)])
def test_running_sums_step_is_the_causal_equation(kernel_calls, key_scale, rising):
    q, k, v = inputs(key_scale, rising)
    y = decode(aft_ops.RunningSums(), *(x.to(DEVICE) for x in (q, k, v)))
    assert len(kernel_calls) == k.shape[1]
    n = k.shape[1]
    assert rel(y, naive_full(q, k, v, torch.zeros(n, n), causal=True)) < 1e-6
    with fast_paths(False):
        plain = decode(aft_ops.RunningSums(), q, k, v)
    assert len(kernel_calls) == n  # the switch turns the kernel off
    assert rel(y, plain) < 1e-6


@pytest.mark.parametrize("key_scale, bias_scale, rising", [(1.0, 1.0, False), (1.0, 1.0, True), (1e4, 1e4, False)])
def test_prefix_cache_step_is_the_causal_equation(kernel_calls, key_scale, bias_scale, rising):
    """Three tiles of 16 cached tokens in the interpreter (the last partial); 1e4: underflowed entries repaired."""
    q, k, v = inputs(key_scale, rising, n=37)
    b, n, c = k.shape
    w = torch.randn(n, n) * bias_scale

    def cache(device):
        return aft_ops.PrefixCache(lambda t: w.to(device)[t, : t + 1], b, n, c, torch.zeros(1, device=device))

    state = cache(DEVICE)
    y = decode(state, *(x.to(DEVICE) for x in (q, k, v)))
    assert len(kernel_calls) == n
    assert rel(y, naive_full(q, k, v, w, causal=True)) < 1e-6
    if rising:  # the cached terms stay bounded by e^margin after the rescales
        assert state.ctx[..., c:].max().item() <= torch.exp(torch.tensor(aft_ops.RESCALE_MARGIN)).item() * 1.0001
    with fast_paths(False):
        plain = decode(cache("cpu"), q, k, v)
    assert len(kernel_calls) == n
    assert rel(y, plain) < 1e-6


def test_states_pass_between_the_kernel_and_the_plain_step(kernel_calls):
    """The switch flipped at every step: each path continues the other's state (rising keys: both rescale)."""
    q, k, v = (x.to(DEVICE) for x in inputs(1.0, True, n=23))
    b, n, c = k.shape
    w = torch.randn(n, n, device=DEVICE)
    for state, bias in ((aft_ops.RunningSums(), torch.zeros_like(w)), (None, w)):
        state = state or aft_ops.PrefixCache(lambda t: w[t, : t + 1], b, n, c, w)
        outs = []
        for t in range(n):
            with fast_paths(t % 2 == 0):
                outs.append(state.advance(q[:, t], k[:, t], v[:, t], t))
        assert rel(torch.stack(outs, 1), naive_full(q.cpu(), k.cpu(), v.cpu(), bias.cpu(), causal=True)) < 1e-6
    assert len(kernel_calls) == 2 * ((n + 1) // 2)


def test_module_decoding_equals_its_full_forward():
    """Causal AFT mixers stepped token by token (kernel steps) equal their causal forward on the sequence."""
    from vitlab.mixers import AFTFull, AFTLocal, AFTSimple, TokenLayout

    torch.manual_seed(3)
    x = torch.randn(2, 19, 16, device=DEVICE)
    mixers = (
        AFTFull(16, max_len=19, bias_dim=4, causal=True),
        AFTLocal(16, max_len=19, window=4, bias_dim=None, causal=True),
        AFTSimple(16, causal=True),
    )
    for m in mixers:
        m = m.to(DEVICE).eval()
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.5)
        with torch.no_grad(), fast_paths(False):
            full = m(x, TokenLayout())
        state = m.init_state(2, 19, x)
        with torch.no_grad():
            steps = torch.stack([m.step(x[:, t], t, state) for t in range(19)], 1)
        assert rel(steps, full) < 1e-5
