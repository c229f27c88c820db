"""Which hardware-dependent fast paths this process takes: decided once per (device, dtype, mode) by running them.

Three paths are decided so. oneDNN's linear primitive (:mod:`vitlab.ops.onednn`): whether it runs depends on the CPU's
instruction set (its bf16 kernels need AVX-512 BF16 or AVX-NE-CONVERT; without them PyTorch refuses or oneDNN finds
no implementation), and whether it pays does too: on an AMD CPU with AVX-512 its fp32 GEMM is about twice MKL's
(whose AVX-512 kernels are dispatched on Intel CPUs only), on an AVX2-only CPU it is slower than MKL. So nothing is
assumed about the CPU: the first call that could take the path asks :func:`onednn_linear`, which

1. runs the primitive's forms (plain, GELU epilogue, residual epilogue; training: both gradient products) on a tiny
   input and compares them with aten's; any error or disagreement means the path is not taken, and
2. times it against aten's products on DeiT-S's MLP for a batch of 8 images (1576 tokens, 384 -> 1536 -> 384 with
   GELU and the residual; training: forward and backward; the current thread count) in :data:`REPEATS` pairs of
   calls, and takes the path only when the median of the pairs' time ratios is at most :data:`MARGIN`: a clear win.
   Where the two are close the answer must not depend on the draw. On a Sapphire Rapids Xeon (MKL's AVX-512 GEMM)
   the fp32 inference MLP read 0.94-1.04 in four fresh processes, so a 3 % margin on the best of three calls took
   oneDNN in some processes and not in others; each taken path then also loads oneDNN's code (megabytes of
   resident memory) for no speed. Where oneDNN pays it pays by more than the margin: about 2x on an AMD EPYC
   (MKL's AVX-512 kernels run on Intel CPUs only); in bf16 inference on the Xeon it read 0.73-0.85.

The memory layout of the CNN stems (Refined-ViT's, DeepViT-S's) in training, :func:`stem_channels_last`: channels-last
is oneDNN's native convolution layout and its convolutions take it without reorders, but the weight gradient of a
channels-last 3x3 convolution has a fast kernel only where oneDNN runs AVX-512; on an AVX2-only AMD EPYC it took
217 ms against 77 ms in the blocked layout an NCHW tensor is reordered to (the stem's 64 -> 128 layer at 112 x 112,
batch 4). So the first training step through a stem times one 3x3 layer's forward and backward in both layouts and
keeps channels-last unless NCHW is faster by the margin.

How AFT-full's inference lays out its operands on the CPU, :func:`aft_channel_major`: channel-major rows
(:func:`vitlab.ops.aft.aft_full_channels`, one product for both sums) or the token-major core (two batched
products). The same FLOPs run through different BLAS shapes, and which is faster depends on the BLAS's kernels: on
a Sapphire Rapids Xeon channel-major won (AFT-full against the community code, fresh processes: 0.92 -> 0.96 at
T = 197), on an AVX2-only AMD EPYC it lost (mixer calls 1.14-1.26x the token-major core's time at T = 197, batch 8,
in four probes). So the first inference call that could take it times both on a ViT's sequence and takes
channel-major when it is faster.

Each probe runs in a thread of its own (the caller's autograd and tracing state stays out of it); the
check of a cached answer runs in the caller's thread with the caller's modes set aside (:func:`_checked`). The answer is
kept for the process and in a per-machine cache file (:func:`cache_path`; :func:`reset` forgets both) and
reported by :func:`decisions`. Under
``torch.compile`` the answer is a constant of the graph (the probe runs while tracing).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from ..common.io import WriteError, write_json_atomic
from . import onednn
from .aft import aft_full, aft_full_channels, linear_transposed

#: oneDNN is taken when the median of its time over aten's is at most this: a clear win, so that the choice is stable
MARGIN = 0.9
#: timed pairs of calls (after one warm-up call of each side), the order alternating from pair to pair
REPEATS = 7
# the timed layer: DeiT-S's MLP on a batch of 8 images (8 x 197 tokens): smaller products understate oneDNN's
# training gain (512 tokens: parity where whole models train 1.06-1.4x faster in oneDNN)
_TOKENS, _WIDTH, _HIDDEN = 1576, 384, 1536


@dataclass(frozen=True)
class Decision:
    """The probe's answer for one (dtype, mode): whether the path ``works`` (runs and agrees with aten), its
    time and aten's in milliseconds (None when it does not work), and whether it is ``taken``."""

    works: bool
    taken: bool
    fast_ms: float | None = None
    plain_ms: float | None = None
    reason: str = ""


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    tol = 2e-2 if want.dtype == torch.bfloat16 else 1e-4
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def _check(dtype: torch.dtype, training: bool) -> None:
    """Run every form of the primitive that the path uses on a tiny input; raise if one fails or disagrees."""
    gen = torch.Generator().manual_seed(0)
    x, w, b, r = (torch.randn(s, generator=gen).to(dtype) for s in ((5, 24), (40, 24), (40,), (5, 40)))
    cases = [
        (onednn.linear(x, w, b), F.linear(x, w, b)),
        (onednn.linear(x, w, b, gelu=True), F.gelu(F.linear(x, w, b))),
        (onednn.linear(x, w, b, residual=r), r + F.linear(x, w, b)),
    ]
    if training:
        g = torch.randn(5, 40, generator=gen).to(dtype)
        cases += [(onednn.grad_input(g, w), g @ w), (onednn.grad_weight(g, x), g.t() @ x)]
    for got, want in cases:
        if not _agrees(got, want):
            raise RuntimeError("the primitive's result differs from aten's")


def _failed(err: Exception) -> Decision:
    """The answer for a path that raised ``err`` while probed: it does not work, the other path is taken."""
    return Decision(False, False, reason=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _time(fast, plain) -> tuple[float, float, float]:
    """The median milliseconds of ``fast`` and of ``plain`` and the median of their ratio over :data:`REPEATS`
    pairs of calls, after one warm-up call each. Each pair's ratio compares two calls made back to back, so a
    slow stretch of the machine moves both; the order within a pair alternates."""
    fast(), plain()
    pairs = []
    for i in range(REPEATS):
        if i % 2:  # aten first
            plain_time = _ms(plain)
            fast_time = _ms(fast)
        else:
            fast_time = _ms(fast)
            plain_time = _ms(plain)
        pairs.append((fast_time, plain_time))
    return (
        statistics.median(f for f, _ in pairs),
        statistics.median(p for _, p in pairs),
        statistics.median(f / p for f, p in pairs),
    )


def _timed_pair(dtype: torch.dtype, training: bool):
    """The timed calls: DeiT-S's MLP on :data:`_TOKENS` tokens with its residual, as the blocks run it, through
    oneDNN (GELU and the residual as epilogues; training: :class:`~vitlab.ops.onednn.OneDNNLinear`, forward and
    backward) and through aten."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_TOKENS, _WIDTH, generator=gen).to(dtype)
    w1, w2 = torch.randn(_HIDDEN, _WIDTH, generator=gen), torch.randn(_WIDTH, _HIDDEN, generator=gen)
    w1, w2 = (w.to(dtype).div_(_WIDTH**0.5).requires_grad_(training) for w in (w1, w2))
    b1, b2 = (torch.zeros(n, dtype=dtype, requires_grad=training) for n in (_HIDDEN, _WIDTH))
    if not training:

        def fast():
            return onednn.linear(onednn.linear(x, w1, b1, gelu=True), w2, b2, residual=x)

        def plain():
            return x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

        return fast, plain
    x.requires_grad_()

    def fast_step():
        h = F.gelu(onednn.OneDNNLinear.apply(x, w1, b1, None))
        onednn.OneDNNLinear.apply(h, w2, b2, x).sum().backward()

    def plain_step():
        (x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)).sum().backward()

    return fast_step, plain_step


# the decisions made so far: the linear layers' by (dtype, training), the others by their names
_DECISIONS: dict[tuple[torch.dtype, bool] | str, Decision] = {}


def decided(dtype: torch.dtype, training: bool) -> Decision | None:
    """The answer this process already has for ``dtype`` and ``training``, or None before the first call (a
    lookup that never probes: :func:`vitlab.ops.linear.onednn_mode` reads a known "not taken" before it
    inspects the call's context)."""
    return _DECISIONS.get((dtype, training))


def onednn_linear_taken(dtype: torch.dtype, training: bool) -> bool:
    """Whether linear layers of ``dtype`` on the CPU run in oneDNN (inference with epilogues, or a training step's
    three products): :func:`onednn_linear`'s answer, a constant inside a compiled graph."""
    return onednn_linear(dtype, training).taken


# what torch.compiler.assume_constant_result does (dynamo calls the function while tracing and records its result
# as a constant: the probe runs in Python, never traced), without the import of torch._dynamo that the decorator
# makes at once: that import would load the compiler into every process that imports vitlab
onednn_linear_taken._dynamo_marked_constant = True  # type: ignore[attr-defined]


def onednn_linear(dtype: torch.dtype, training: bool) -> Decision:
    """The probe of this module's docstring for linear layers of ``dtype`` on the CPU, inference or training
    (probed on the first call, then remembered by the process and the machine's cache)."""
    return _remembered((dtype, training), partial(_probe, dtype, training), partial(_checked, dtype, training))


def _remembered(
    key: tuple[torch.dtype, bool] | str,
    run_probe: Callable[[], Decision],
    still_works: Callable[[], bool] | None = None,
) -> Decision:
    """The decision under ``key``: this process's, else the machine cache's (a cached "taken" only if
    ``still_works()``, where given), else ``run_probe()`` in a thread of its own (:func:`_isolated`), then cached."""
    if key not in _DECISIONS:
        cached = _read_cache().get(_name(key))
        if cached and (not cached["taken"] or still_works is None or still_works()):
            _DECISIONS[key] = Decision(**cached)
        else:
            _DECISIONS[key] = _isolated(run_probe)
            _write_cache(key)
    return _DECISIONS[key]


# --------------------------------------------------------------------------- the CNN stems' layout in training
_STEM = "stem_channels_last,train"
# the timed layer: Refined-ViT's second stem convolution (3x3, 32 -> 64, with its input gradient) on one image's
# 112 x 112 maps, ~30 ms a call. The maps' size decides, not the batch: on the AVX2-only EPYC channels-last took
# 1.20-1.44x NCHW's time here and 1.28-1.51x at 112 x 112 for batches 1-4 and 64 channels, but 0.92x at 56 x 56
_STEM_INPUT, _STEM_OUT = (1, 32, 112, 112), 64


def stem_channels_last() -> Decision:
    """Whether a CNN stem's training step runs in channels-last memory (``taken``) or in the input's NCHW layout:
    the module docstring's probe, on the first call, then remembered by the process and the machine's cache."""
    return _remembered(_STEM, _probe_stem)


def stem_channels_last_taken() -> bool:
    """:func:`stem_channels_last`'s answer, a constant inside a compiled graph."""
    return stem_channels_last().taken


stem_channels_last_taken._dynamo_marked_constant = True  # type: ignore[attr-defined]  # as onednn_linear_taken


def _probe_stem() -> Decision:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(_STEM_OUT, _STEM_INPUT[1], 3, 3, generator=gen).div_(24).requires_grad_()
    image = torch.randn(_STEM_INPUT, generator=gen)

    def step(layout: torch.memory_format) -> Callable[[], None]:
        x = image.contiguous(memory_format=layout).requires_grad_()
        return lambda: F.conv2d(x, weight, padding=1).relu().sum().backward()

    try:
        with torch.enable_grad():
            channels_last_ms, nchw_ms, ratio = _time(step(torch.channels_last), step(torch.contiguous_format))
    except Exception as err:  # a convolution that fails in one layout: the input's own layout, no conversion
        return _failed(err)
    # channels-last stays unless NCHW is faster by the margin: NCHW's time over channels-last's at most MARGIN
    taken = 1 / ratio > MARGIN
    verdict = "kept" if taken else "left for NCHW"
    return Decision(
        True,
        taken,
        round(channels_last_ms, 3),
        round(nchw_ms, 3),
        f"channels-last {verdict} ({ratio:.2f}x NCHW's time in a 3x3 convolution's training step)",
    )


# --------------------------------------------------------------------------- AFT-full's inference layout (CPU, fp32)
_AFT = "aft_full_channel_major,infer"
# the timed call: AFT-full (projections and core, d = 256, a full 197 x 197 bias) on 8 sequences of a ViT's 197
# tokens, ~20 ms a call; both layouts hold the same tensors' sizes, so a wrong answer near parity costs nothing
# measurable and the rule has no margin
_AFT_BATCH, _AFT_TOKENS, _AFT_WIDTH = 8, 197, 256


def aft_channel_major() -> Decision:
    """Whether AFT-full's CPU inference runs on channel-major rows (``taken``) or on the token-major core: the
    module docstring's probe, on the first call, then remembered by the process and the machine's cache."""
    return _remembered(_AFT, _probe_aft)


def _probe_aft() -> Decision:
    b, n, c = _AFT_BATCH, _AFT_TOKENS, _AFT_WIDTH
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b * n, c, generator=gen)
    qkv, proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
    w = torch.randn(n, n, generator=gen) * 0.01

    def channel_major() -> torch.Tensor | None:
        y_t = aft_full_channels(linear_transposed(qkv, x), b, w)
        return None if y_t is None else F.linear(y_t.t(), proj.weight, proj.bias)

    def token_major() -> torch.Tensor:  # as the mixer: three products (aten's), each its own contiguous buffer
        q, k, v = (F.linear(x, qkv.weight[i * c : (i + 1) * c], qkv.bias[i * c : (i + 1) * c]) for i in range(3))
        q, k, v = (t.view(b, n, c) for t in (q, k, v))
        return F.linear(aft_full(q, k, v, w).view(b * n, c), proj.weight, proj.bias)

    try:
        with torch.no_grad():
            got = channel_major()
            if got is None:
                raise RuntimeError("the channel-major core gave no result (its sums underflowed)")
            if not _agrees(got, token_major()):
                raise RuntimeError("the channel-major core's result differs from the token-major core's")
            channel_ms, token_ms, ratio = _time(channel_major, token_major)
    except Exception as err:  # the token-major core is the reference path
        return _failed(err)
    taken = ratio < 1.0
    verdict = "taken" if taken else "not faster"
    return Decision(
        True,
        taken,
        round(channel_ms, 3),
        round(token_ms, 3),
        f"channel-major {verdict} ({ratio:.2f}x the token-major core's time in AFT-full's inference)",
    )


def _checked(dtype: torch.dtype, training: bool) -> bool:
    """:func:`_still_works` in the calling thread, with the caller's dispatch modes (a FLOP counter, activation
    checkpointing's hooks' modes) and autocast set aside for the check's few operations; in a thread of its own
    (:func:`_isolated`) only while torch.compile traces or a function mode (``torch.device``) is active, which
    would change the tensors the check makes. Why not always a thread: one that runs oneDNN starts an OpenMP team
    of its own, and the side-by-side benchmarks count FLOPs in every case's first step. (Fresh DeiT-Ti processes
    with the check in a thread and in the caller's thread ran at the same speed within the noise; the caller's
    thread is the simpler path and keeps the check's products out of the caller's FLOP count.)"""
    if torch.compiler.is_compiling() or torch._C._len_torch_function_stack() > 0:
        return _isolated(_still_works, dtype, training)
    with _disable_current_modes(), torch.autocast("cpu", enabled=False):
        return _still_works(dtype, training)


def _still_works(dtype: torch.dtype, training: bool) -> bool:
    """The tiny correctness check alone, for a cached answer that takes the path (a stale or edited cache file
    then costs a probe, never an error)."""
    try:
        with torch.no_grad():
            _check(dtype, training)
        return True
    except Exception:
        return False


# --------------------------------------------------------------------------- the machine's cache of decisions
# Probing costs time and, more, memory: both products are initialised (oneDNN's and the BLAS's code and buffers,
# 30-50 MB of resident memory in the first call) where a process then uses one. So the answers are kept per
# machine, as a compiler keeps its autotuning: a JSON file under VITLAB_CACHE_DIR (default
# $XDG_CACHE_HOME/vitlab or ~/.cache/vitlab), named by everything the answer depends on. An unreadable or foreign
# file is ignored (probed again); a folder that cannot be written only leaves the answers uncached.
# 2: the decision reads the median ratio of paired calls against a 0.9 margin (1: best of three, 0.97), so an
# answer of the old rule is probed again
_CACHE_VERSION = 2
# the variables that limit the kernels' instruction set, and glibc's malloc settings, which move what the timed
# paths cost: channel-major AFT-full read 0.93-0.99 of the token-major core's time (then on the fused projection's
# views) with glibc's defaults and 1.19-1.20 with large buffers kept on the heap, on the same CPU
_ENVIRONMENT = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "GLIBC_TUNABLES",
)


def _name(key: tuple[torch.dtype, bool] | str) -> str:
    if isinstance(key, str):
        return key
    return f"{str(key[0]).removeprefix('torch.')},{'train' if key[1] else 'infer'}"


def cache_path() -> Path | None:
    """The file this machine's decisions are kept in, or None when caching is off (``VITLAB_CACHE_DIR=off``)."""
    folder = os.environ.get("VITLAB_CACHE_DIR")
    if folder is None:
        folder = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vitlab")
    if folder.strip().lower() in ("", "0", "off", "none"):
        return None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        cpu = platform.processor() or platform.machine()
    what = [_CACHE_VERSION, torch.__version__, cpu, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()]
    what += [os.environ.get(name, "") for name in _ENVIRONMENT]
    digest = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]
    return Path(folder) / f"ops-probe-{digest}.json"


def _read_cache() -> dict[str, dict]:
    path = cache_path()
    try:
        entries = json.loads(path.read_text()) if path is not None and path.is_file() else {}
        fields = set(Decision.__dataclass_fields__)
        return {k: v for k, v in entries.items() if isinstance(v, dict) and set(v) == fields}
    except (OSError, ValueError, AttributeError):
        return {}


def _write_cache(key: tuple[torch.dtype, bool] | str) -> None:
    """Adds the answer this process probed under ``key`` to the machine's cache: that one only, so that a decision
    set in the process by other means (a test, an A/B script forcing a path) never becomes the machine's."""
    path = cache_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**_read_cache(), _name(key): asdict(_DECISIONS[key])})
    except (OSError, WriteError):
        pass


def _isolated(fn: Callable[..., Decision], *args) -> Decision:
    """``fn(*args)`` in a thread of its own. The first call that needs a decision may run anywhere: under
    activation checkpointing (saved-tensor hooks), a FLOP counter or another dispatch mode, inference mode,
    autocast, or while torch.compile traces with fake tensors. All of these are thread-local, so the probe's
    operations neither see them nor are seen by them."""
    result: list[Decision] = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)), name="vitlab-probe")
    thread.start()
    thread.join()
    return result[0]


def _probe(dtype: torch.dtype, training: bool) -> Decision:
    if not _available():
        return Decision(False, False, reason="PyTorch was built without oneDNN")
    if training and dtype != torch.float32:
        return Decision(False, False, reason="training in oneDNN is for fp32 (autocast picks its own precisions)")
    try:
        with torch.no_grad():
            _check(dtype, training)
        with torch.enable_grad() if training else torch.no_grad():
            fast_ms, plain_ms, ratio = _time(*_timed_pair(dtype, training))
    except Exception as err:  # any failure of the primitive on this CPU: the plain path
        return _failed(err)
    return decide(fast_ms, plain_ms, ratio)


def decide(fast_ms: float, plain_ms: float, ratio: float) -> Decision:
    """The answer for a working primitive whose pairs of calls took ``fast_ms`` and ``plain_ms`` (medians) with
    the median time ratio ``ratio``: taken when ``ratio <= MARGIN``."""
    taken = ratio <= MARGIN
    verdict = "faster" if taken else f"not faster by {1 / MARGIN:.2f}x"
    return Decision(
        True, taken, round(fast_ms, 3), round(plain_ms, 3), f"oneDNN {verdict} than aten ({ratio:.2f}x its time)"
    )


def decisions() -> dict[str, dict]:
    """Every decision of this module, as plain data (probing now what has not been probed yet)."""
    report = {
        f"onednn_linear[{str(dtype).removeprefix('torch.')},{'train' if training else 'infer'}]": asdict(
            onednn_linear(dtype, training)
        )
        for dtype in (torch.float32, torch.bfloat16)
        for training in (False, True)
    }
    return {
        **report,
        "stem_channels_last[train]": asdict(stem_channels_last()),
        "aft_full_channel_major[infer]": asdict(aft_channel_major()),
    }


def reset() -> None:
    """Forget the decisions of this process and of the machine's cache (the next call probes again)."""
    _DECISIONS.clear()
    path = cache_path()
    if path is not None:
        path.unlink(missing_ok=True)
