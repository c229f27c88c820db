"""The AFT family's Triton kernels (vitlab.ops.triton_aft, triton_aft_simple): values and gradients equal to the
paper's equation in float64 and to the CPU cores, causal and not, odd lengths, band edges, huge logits.

With a GPU the kernels run compiled on CUDA tensors. Without one they run on CPU tensors in Triton's interpreter,
which must be chosen before ``triton`` is first imported (``TRITON_INTERPRET=1``: the language's own helpers are
decorated then). A pytest process started with it set runs this file's tests directly (``scripts/test.sh`` has a
step ``TRITON_INTERPRET=1 pytest tests/test_triton_*.py``, slow cases included); in any other CPU process (the
default suite, where torch imported triton long before) they are skipped, and one ``slow`` test runs the quick ones
in a fresh process with the interpreter on, with those of AFT-conv's and the decoding step's kernels
(``test_triton_aft_conv.py``, ``test_triton_aft_decode.py``; ~60 s of CPU). The rest of the matrix is ``slow``
too: the interpreter runs each program with NumPy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vitlab
from test_aft import naive_full
from vitlab.mixers import AFTFull, AFTLocal, AFTSimple, TokenLayout
from vitlab.ops import aft as aft_ops
from vitlab.ops import fast_paths

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
INTERPRETED = not CUDA and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_kernels = pytest.mark.skipif(
    not (CUDA or INTERPRETED), reason="Triton's interpreter is off in this process: test_in_the_interpreter runs these"
)


@pytest.mark.slow
@pytest.mark.skipif(CUDA or INTERPRETED, reason="the kernels' tests run in this process")
def test_in_the_interpreter():
    """This file's quick tests (and the AFT-conv and decoding kernels' tests) in a fresh process with
    ``TRITON_INTERPRET=1``: they must pass there."""
    src = str(Path(vitlab.__file__).parents[1])  # the vitlab this process tests
    path = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-m", "not slow"]
    repo = Path(__file__).parents[1]
    files = [__file__, *(str(Path(__file__).with_name(f"test_triton_aft_{x}.py")) for x in ("conv", "decode"))]
    done = subprocess.run([*cmd, *files], env=env, cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


@pytest.fixture
def kernels():
    """The kernel modules (imported here: they import triton)."""
    from vitlab.ops import triton_aft, triton_aft_simple

    return {"full": triton_aft, "simple": triton_aft_simple}


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double().cpu()
    return ((actual.double().cpu() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def effective_bias(w: torch.Tensor, window: int, outside_zero: bool) -> torch.Tensor:
    """AFT-local's bias: w inside the band |t - t'| < window, 0 (or excluded) outside; window 0 keeps all."""
    if not window:
        return w
    n = w.shape[0]
    far = (torch.arange(n)[:, None] - torch.arange(n)[None]).abs() >= window
    return w.masked_fill(far, 0.0 if outside_zero else float("-inf"))


def grads(y: torch.Tensor, g: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((y * g.to(y.dtype)).sum(), inputs)


# ---------------------------------------------------------------- AFT-simple


SIMPLE_CASES = [(False, 1.0), pytest.param(True, 1.0, marks=pytest.mark.slow), (False, 1e4), (True, 1e4)]


@needs_kernels
@pytest.mark.parametrize("causal, scale", SIMPLE_CASES)
def test_simple_kernel_is_the_paper_equation(kernels, causal, scale):
    torch.manual_seed(0)
    b, n, c = 2, 37, 12  # three chunks of 16 in the interpreter, the last one partial
    qkv = torch.randn(b, n, 3 * c, dtype=torch.float64)
    qkv[..., c : 2 * c] *= scale
    ref_in = qkv.clone().requires_grad_()
    x = qkv.float().to(DEVICE).requires_grad_()
    y = kernels["simple"].aft_simple_triton(x, causal)
    q, k, v = ref_in.chunk(3, -1)
    ref = naive_full(q, k, v, torch.zeros(n, n, dtype=torch.float64), causal)
    assert rel(y, ref) < 1e-6
    g = torch.randn(b, n, c, dtype=torch.float64)
    (gx,), (gref,) = grads(y, g.to(DEVICE), [x]), grads(ref, g, [ref_in])
    assert rel(gx, gref) < 1e-5
    plain = qkv.float().requires_grad_()  # the CPU core in fp32: the same function
    (gp,) = grads(aft_ops.aft_simple(*plain.chunk(3, -1), causal), g, [plain])
    assert rel(gx, gp) < 1e-5


# ---------------------------------------------------------------- AFT-full and AFT-local

# (causal, factorised, window, outside_zero): AFT-full (window 0), windows at a tile's edges (16 = the
# interpreter's tile), one spanning the sequence, and the -inf ablation
BIASED_CASES = [
    (causal, factored, window, outside)
    for causal in (False, True)
    for factored in (True, False)
    for window, outside in ((0, True), (1, True), (5, True), (5, False), (16, True), (17, True), (40, True))
]
QUICK = {(True, True, 0, True), (False, True, 5, True), (True, False, 17, True)}


@needs_kernels
@pytest.mark.parametrize(
    "causal, factored, window, outside",
    [case if case in QUICK else pytest.param(*case, marks=pytest.mark.slow) for case in BIASED_CASES],
)
def test_biased_kernel_is_the_paper_equation(kernels, causal, factored, window, outside):
    torch.manual_seed(1)
    b, n, c, r = 2, 37, 12, 40  # rank 40: two whole blocks of the bias rank and a part (16 in the interpreter)
    q, k, v = (torch.randn(b, n, c, dtype=torch.float64) for _ in range(3))
    u, vb = torch.randn(n, r, dtype=torch.float64) * 0.5, torch.randn(n, r, dtype=torch.float64) * 0.5
    table = torch.randn(n, n, dtype=torch.float64)
    leaves = [k, v, u, vb] if factored else [k, v, table]
    ref_in = [t.clone().requires_grad_() for t in leaves]
    dev_in = [t.float().to(DEVICE).requires_grad_() for t in leaves]
    bias_args = lambda ts: (ts[2], ts[3], None) if factored else (None, None, ts[2])  # noqa: E731
    y = kernels["full"].aft_biased_triton(
        q.float().to(DEVICE), *dev_in[:2], *bias_args(dev_in), causal, window, outside
    )
    w_ref = ref_in[2] @ ref_in[3].T if factored else ref_in[2]
    ref = naive_full(q, ref_in[0], ref_in[1], effective_bias(w_ref, window, outside), causal)
    assert rel(y, ref) < 1e-6
    g = torch.randn(b, n, c, dtype=torch.float64)
    for got, want in zip(grads(y, g.to(DEVICE), dev_in), grads(ref, g, ref_in)):
        assert rel(got, want) < 1e-5


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
def test_biased_kernel_exact_for_huge_keys_and_biases(kernels, causal, monkeypatch):
    """Keys and biases of magnitude 1e4: the max-shifted sums underflow for some entries, which are recomputed
    exactly; values equal the paper's equation and the CPU core, gradients the CPU core's (held exact by
    test_aft)."""
    torch.manual_seed(2)
    b, n, c = 2, 24, 8
    q, v = torch.randn(b, n, c), torch.randn(b, n, c)
    k, w = torch.randn(b, n, c) * 1e4, torch.randn(n, n) * 1e4
    repaired = []
    exact = aft_ops._exact_entries
    monkeypatch.setattr(aft_ops, "_exact_entries", lambda *a: repaired.append(len(a[3])) or exact(*a))
    kd, wd = k.to(DEVICE).requires_grad_(), w.to(DEVICE).requires_grad_()
    y = kernels["full"].aft_biased_triton(q.to(DEVICE), kd, v.to(DEVICE), w=wd, causal=causal)
    assert sum(repaired) > 0
    assert rel(y, naive_full(q, k, v, w, causal)) < 1e-5
    kc, wc = k.clone().requires_grad_(), w.clone().requires_grad_()
    plain = aft_ops.aft_full(q, kc, v, wc, causal)
    g = torch.randn(b, n, c)
    for got, want in zip(grads(y, g.to(DEVICE), [kd, wd]), grads(plain, g, [kc, wc])):
        assert rel(got, want) < 1e-5


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_take_low_precision_inputs_and_accumulate_in_fp32(kernels, dtype):
    torch.manual_seed(3)
    b, n, c = 2, 21, 16
    q, k, v = (torch.randn(b, n, c).to(dtype) for _ in range(3))
    u, vb = torch.randn(n, 4), torch.randn(n, 4)
    y = kernels["full"].aft_biased_triton(*(t.to(DEVICE) for t in (q, k, v, u, vb)), causal=True)
    assert y.dtype == torch.float32
    ref = naive_full(q, k, v, u.double() @ vb.double().T, causal=True)  # the rounded inputs, exactly
    assert rel(y, ref) < (1e-6 if DEVICE.type == "cpu" else 2e-3)  # TF32 products on the GPU
    qkv = torch.cat([q, k, v], -1)
    x = qkv.to(DEVICE).requires_grad_()
    ys = kernels["simple"].aft_simple_triton(x, True)
    assert ys.dtype == torch.float32 and rel(ys, naive_full(q, k, v, torch.zeros(n, n), True)) < 1e-6
    ref_in = qkv.double().requires_grad_()
    g = torch.randn(b, n, c)
    (gx,), (gref,) = grads(ys, g.to(DEVICE), [x]), grads(aft_ops.aft_simple(*ref_in.chunk(3, -1), True), g, [ref_in])
    assert gx.dtype == dtype and rel(gx, gref) < 1e-2  # the gradient rounded to the projection's dtype


@needs_kernels
def test_underflowed_entries_repaired_for_bf16_keys(kernels):
    """bf16 keys of magnitude 1e4 (a GPU under autocast): the exact recomputation returns fp32 entries."""
    torch.manual_seed(2)
    b, n, c = 2, 24, 8
    q, v = torch.randn(b, n, c).bfloat16(), torch.randn(b, n, c).bfloat16()
    k, w = (torch.randn(b, n, c) * 1e4).bfloat16(), torch.randn(n, n) * 1e4
    kd, wd = k.to(DEVICE).requires_grad_(), w.to(DEVICE).requires_grad_()
    y = kernels["full"].aft_biased_triton(q.to(DEVICE), kd, v.to(DEVICE), w=wd, causal=True)
    assert y.dtype == torch.float32 and rel(y, naive_full(q, k, v, w, True)) < 1e-5
    y.sum().backward()
    assert kd.grad.dtype == torch.bfloat16 and torch.isfinite(kd.grad).all() and torch.isfinite(wd.grad).all()


# ---------------------------------------------------------------- the modules' dispatch


slow = pytest.mark.slow
MODULES = [
    pytest.param(AFTFull, dict(max_len=37), marks=slow),
    (AFTFull, dict(max_len=37, bias_dim=None, causal=True)),
    pytest.param(AFTLocal, dict(max_len=37, window=6), marks=slow),
    (AFTLocal, dict(max_len=37, window=6, causal=True, outside="-inf")),
    pytest.param(AFTLocal, dict(max_len=45, window=6, causal=True, recompute=True), marks=slow),  # N < max_len
    pytest.param(AFTLocal, dict(max_len=37, window=0), marks=slow),
    (AFTSimple, dict(causal=True)),
]


@needs_kernels
@pytest.mark.parametrize("cls, kw", MODULES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_modules_take_the_kernels_and_equal_the_plain_path(kernels, cls, kw, monkeypatch):
    torch.manual_seed(4)
    m = cls(16, **kw).to(DEVICE)
    for p in m.parameters():  # biases large enough that a wrong band or mask shows
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 37, 16, device=DEVICE)
    calls = []
    for name, fn in (("full", "aft_biased_triton"), ("simple", "aft_simple_triton")):
        original = getattr(kernels[name], fn)
        monkeypatch.setattr(kernels[name], fn, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    y = m(x, TokenLayout())
    assert calls, "the module did not take the Triton kernels"
    gy = torch.randn_like(y)
    got = torch.autograd.grad((y * gy).sum(), list(m.parameters()))
    calls.clear()
    with fast_paths(False):  # the one switch: the plain composite path
        y_plain = m(x, TokenLayout())
        want = torch.autograd.grad((y_plain * gy).sum(), list(m.parameters()))
    assert not calls
    assert rel(y, y_plain) < 1e-5
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-4


def test_sums_take_one_tf32_pass_only_for_half_precision_inputs():
    """On a GPU the sums' products run at fp32 accuracy (3 TF32 passes) for fp32 and float64 inputs, one pass for
    bf16/fp16; the bias always at fp32 accuracy."""
    from types import SimpleNamespace

    from vitlab.ops.triton_aft import _precisions

    def on_gpu(dtype):
        return _precisions(SimpleNamespace(device=torch.device("cuda"), dtype=dtype))

    assert on_gpu(torch.bfloat16)["PREC"] == on_gpu(torch.float16)["PREC"] == "tf32"
    assert on_gpu(torch.float32)["PREC"] == on_gpu(torch.float64)["PREC"] == "tf32x3"
    assert {on_gpu(d)["BIAS_PREC"] for d in (torch.bfloat16, torch.float32, torch.float64)} == {"tf32x3"}


class SharedMemoryShort:
    """A kernel standing in for one that asks more shared memory than a GPU has unless it runs with at most
    ``fits`` pipelining stages: Triton raises ``OutOfResources`` before the launch; the stages asked are kept."""

    def __init__(self, kernel, fits: int) -> None:
        self.kernel, self.fits, self.asked = kernel, fits, []
        self.__name__ = getattr(kernel, "__name__", "stand-in")

    def __getitem__(self, grid):
        def run(*args, num_stages=None, **meta):
            from triton.runtime.errors import OutOfResources

            self.asked.append(num_stages)
            if num_stages is None or num_stages > self.fits:
                raise OutOfResources(245760, 232448, "shared memory")
            return self.kernel[grid](*args, **meta)

        return run


@needs_kernels
@pytest.mark.parametrize("factored, window", [(True, 0), (False, 5)])
def test_kernels_on_a_gpu_short_of_shared_memory_take_fewer_stages(kernels, factored, window, monkeypatch):
    """Each of the three AFT-full/local kernels, refused at Triton's default pipelining and at 2 stages (as an
    H200 refused them), runs unpipelined with the same values and gradients; the stages that fit are kept."""
    torch.manual_seed(2)
    b, n, c, r = 2, 37, 12, 8
    q, k, v = (torch.randn(b, n, c, device=DEVICE) for _ in range(3))
    bias = [torch.randn(n, r, device=DEVICE) * 0.5, torch.randn(n, r, device=DEVICE) * 0.5] if factored else []
    table = None if factored else torch.randn(n, n, device=DEVICE)
    full = kernels["full"]

    def values_and_grads():
        leaves = [t.clone().requires_grad_() for t in (k, v, *bias, *([table] if table is not None else []))]
        u, vb, w = (leaves[2], leaves[3], None) if factored else (None, None, leaves[2])
        y = full.aft_biased_triton(q, leaves[0], leaves[1], u, vb, w, False, window, True)
        return [y, *torch.autograd.grad(y.square().sum(), leaves)]

    want = values_and_grads()
    short = {
        name: SharedMemoryShort(getattr(full, name), fits=1) for name in ("_sums_fwd", "_sums_bwd_kv", "_sums_bwd_w")
    }
    for name, kernel in short.items():
        monkeypatch.setattr(full, name, kernel)
    for got, ref in zip(values_and_grads(), want, strict=True):  # equal but for the order of the GPU's atomic adds
        assert rel(got, ref) < 1e-6
    assert all(kernel.asked == [None, 2, 1] for kernel in short.values()), {n: s.asked for n, s in short.items()}
    values_and_grads()  # the next call launches with the stages that fit at once
    assert all(kernel.asked == [None, 2, 1, 1] for kernel in short.values())


def test_a_kernel_that_fits_at_no_stage_count_is_one_clear_error():
    from vitlab.ops.triton_support import launch

    short = SharedMemoryShort(None, fits=0)
    with pytest.raises(RuntimeError, match=r"does not fit this GPU even unpipelined.*VITLAB_FAST_PATHS=0"):
        launch(short, (1,), torch.zeros(1))
    assert short.asked == [None, 2, 1]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the allocator's peak)")
@pytest.mark.parametrize("cls, kw", [(AFTFull, {}), (AFTLocal, dict(window=64))])
def test_no_token_by_token_tensor_on_the_gpu(cls, kw):
    """A training step of AFT-full/local at T = 4096 with 32 channels: the activations are ~MBs, a (T, T) fp32
    tensor alone would be 64 MiB. The step measured is the second: measured first, this test read 74 MB on an H200,
    where the first step also takes one-time allocations whatever T (cuBLAS's workspaces are tens of MiB on a
    Hopper GPU; that this was all of it is not yet confirmed on a GPU)."""
    n = 4096
    m = cls(32, max_len=n, bias_dim=16, **kw).cuda()
    x = torch.randn(1, n, 32, device="cuda", requires_grad=True)
    m(x, TokenLayout()).square().sum().backward()
    x.grad = None
    m.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m(x, TokenLayout()).square().sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < n * n * 4 // 2


# ---------------------------------------------------------------- the GPU benchmark's cases, on the CPU


def test_bench_pre_kernel_cases_turn_the_kernels_off_and_ratios_take_a_baseline(monkeypatch):
    from vitlab.mixers import aft as aft_mixers
    from vitlab.tasks.lm import bench

    monkeypatch.setattr(aft_mixers, "triton_runs_on", aft_mixers.triton_runs_on)  # restored after the test
    step = bench.prepare_case("aft_full_pre", T=32, layers=1, dim=16, batch=1)
    step.fn()
    assert step.info["mixer"][0] == "aft_full" and "triton_kernels" not in step.info["mixer"][1]
    x = torch.zeros(1, device="cuda" if CUDA else "cpu")
    assert not aft_mixers.triton_runs_on(x)
    results = [
        {"model": m, "T": 1024, "status": "ok", "step_s": s, "mem_mb": mem}
        for m, s, mem in (("aft_full", 1.0, 50.0), ("transformer_enwik8_flash", 2.0, 100.0))
    ]
    rows = {r["model"]: r for r in bench.ratios(results, "transformer_enwik8_flash")}
    assert rows["aft_full"]["speed_ratio"] == 2.0 and rows["aft_full"]["mem_ratio"] == 0.5
