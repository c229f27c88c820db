"""Measuring helpers shared by the benchmarks: timing and honest peak memory.

* :func:`time_callable` times a zero-argument callable (warmup, then repeats)
  and summarises the times robustly (median and inter-quartile range); on a GPU
  each call is timed with CUDA events and a synchronisation (:func:`vitlab.common.device.time_call`).
* :class:`CaseRunner` (or :func:`run_case`) runs a benchmark case in **fresh
  processes**, so its peak resident memory is its own (no allocator caches or
  earlier peaks of other cases). A case is its setup function (module-level, so
  that the fresh process can import it; or its path ``"package.module:function"``);
  the function receives the case's parameters, does the setup (builds the model,
  allocates the inputs) and returns the callable to measure (or a
  :class:`Prepared`). Two passes, each in its own process:

  - *memory*: glibc's allocator is made tight first
    (:func:`vitlab.common.runtime.return_freed_memory`: freed blocks go back to the OS, so RSS
    follows the live tensors), the RSS after
    setup is the *baseline*, the kernel's peak-RSS counter is reset (Linux), the
    callable runs once, and ``peak - baseline`` is the memory that call needed; on the
    CPU also the peak of its tensors alone, exact from the profiler's allocation record
    (:func:`tensor_peak_bytes`: what the RSS holds beyond it is the allocator's and first use's);
  - *time*: the allocator of the ``vitlab`` command (``CaseSpec.allocator``, default
    :func:`vitlab.common.runtime.keep_freed_memory`), warmup + timed repeats, median and IQR.

``python -m vitlab.measure.process --self-check`` allocates a known amount in a
fresh process and prints what was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import resource
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..common.device import device_memory, reset_peak_memory, time_call
from ..common.runtime import allocator_policy, keep_freed_memory, return_freed_memory

MB = 1024 * 1024
GB = 1024 * MB


# --------------------------------------------------------------------------- the case process


def warm_process() -> None:
    """Start what every case would start on its first call: the thread pool, BLAS, the autograd engine.

    These cost ~60 MB of resident memory once per process (torch 2.13 CPU; ~30 MB of it are the Python
    modules the first ``backward(gradient)`` imports), whatever is benchmarked; done before the baseline,
    they are not counted as the case's memory.
    """
    import torch

    lin = torch.nn.Linear(64, 64)
    x = torch.randn(4096, 64, requires_grad=True)
    y = lin(x).exp()
    y.backward(torch.ones_like(y))  # the same call as a train case makes
    (torch.ones(256, 256) @ torch.ones(256, 256)).sum().item()


# --------------------------------------------------------------------------- memory of this process


def current_rss_bytes() -> int | None:
    """Resident set size of this process now (Linux ``/proc``), or None where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``VmHWM``; ``ru_maxrss`` as fallback)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS (Linux >= 4.0). True if it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ start/stop lines bypass Python's streams)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def tensor_peak_bytes(fn: Callable[[], object]) -> int | None:
    """The peak of the bytes held by torch's CPU tensors during a call of ``fn``, over what they held as it began.

    Read from the profiler's record of every CPU allocation and free, so it is exact whatever the allocator does
    with freed memory; the RSS also counts the heap the allocator keeps or fragments and library code paged in on
    first use. ``fn`` runs twice and the second call is measured: a free is recorded with its size only for a block
    allocated while the profiler ran. None where the record is unavailable (another torch build).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    try:
        from torch._C._profiler import _EventType

        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
            with record_function("vitlab::measured_call"):
                fn()
        start, allocs, stack = None, [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                allocs.append((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size))
            elif e.name == "vitlab::measured_call":
                start = e.start_time_ns
    except (ImportError, AttributeError, RuntimeError):
        return None
    if start is None:
        return None
    allocs = sorted(a for a in allocs if a[0] >= start)
    if not allocs:
        return 0
    held_before = allocs[0][1] - allocs[0][2]
    return max(0, max(total for _, total, _ in allocs) - held_before)


# --------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Wall times (seconds) of the timed repeats, with robust summaries."""

    times: list[float]
    warmup: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def q1(self) -> float:
        return _quantile(self.times, 0.25)

    @property
    def q3(self) -> float:
        return _quantile(self.times, 0.75)

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def summary(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "q1": self.q1,
            "q3": self.q3,
            "iqr": self.iqr,
            "min": min(self.times),
            "mean": statistics.fmean(self.times),
            "n": len(self.times),
            "warmup": self.warmup,
            "times": self.times,
        }


def _quantile(xs: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), defined for a single value too."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def time_callable(
    fn: Callable[[], object],
    *,
    warmup: int = 1,
    repeats: int = 5,
    max_time: float | None = None,
    device: str | torch.device = "cpu",
) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then up to ``repeats`` timed ones, each timed on ``device``
    (:func:`vitlab.common.device.time_call`: CUDA events and a synchronisation on a GPU, the wall clock on the CPU).

    With ``max_time`` (seconds), the number of timed calls is cut so that they
    take about that long in total (estimated from the slowest warmup call), but
    at least one: a case slower than ``max_time`` per call is timed once.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    dev = torch.device(device)
    slowest = max((time_call(fn, dev) for _ in range(warmup)), default=0.0)
    n = repeats
    if max_time is not None and slowest > 0:
        n = min(repeats, max(1, round(max_time / slowest)))
    return Timing([time_call(fn, dev) for _ in range(n)], warmup)


# --------------------------------------------------------------------------- cases in a fresh process


class CaseSkipped(Exception):
    """Raised by a case's setup when the case cannot run here (the message says why)."""


@dataclass
class Prepared:
    """What a case's setup returns: the callable to measure and facts about the case."""

    fn: Callable[[], object]
    info: dict[str, Any] = field(default_factory=dict)
    #: frees what a call leaves behind (e.g. gradients), run before each baseline is taken
    reset: Callable[[], None] | None = None
    #: where the call runs: timed with CUDA events there, and its GPU memory measured beside the RSS
    device: str = "cpu"


@dataclass
class CaseSpec:
    """A case to run in a fresh process (everything must be JSON-serialisable)."""

    #: the case's setup: a module-level function, or its import path "package.module:function" (the fresh
    #: process imports it by that path, so a function must be importable from its module)
    target: Callable[..., Any] | str
    params: dict[str, Any] = field(default_factory=dict)
    warmup: int = 1
    repeats: int = 5
    max_time: float | None = None
    threads: int | None = None  # torch.set_num_threads in the child (None: leave torch's default)
    #: "memory": one call under a tight allocator; "time": warmup + timed calls; each in its own process
    passes: tuple[str, ...] = ("memory", "time")
    #: the time pass's allocator: "keep" (what the vitlab command uses) or "default" (glibc's own policy)
    allocator: str = "keep"


ISOLATIONS = ("forkserver", "subprocess")
PASSES = ("memory", "time")
# imported once by the fork server: torch, and the modules torch imports lazily on the first
# ``backward(gradient)`` (sympy via symbolic_shapes, ~1 s and ~30 MB), which no case should pay for
PRELOAD = ("torch", "torch.fx.experimental.symbolic_shapes")


class CaseRunner:
    """Runs cases, each in a fresh process; use as a context manager.

    ``isolation="forkserver"`` forks every case from a server process that has
    only imported ``preload`` (it never runs a case, never starts a thread pool),
    so a case skips the interpreter and torch start-up yet inherits no other
    case's memory. ``"subprocess"`` starts a new interpreter per case (slower,
    the same figures). A case that hangs past ``timeout`` seconds is killed.
    """

    def __init__(
        self, isolation: str = "forkserver", timeout: float = 600.0, preload: tuple[str, ...] = PRELOAD
    ) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        self.isolation, self.timeout, self.preload = isolation, timeout, preload
        self._server: subprocess.Popen | None = None

    def __enter__(self) -> CaseRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.stdin.close()  # the server exits at end of input
            try:
                self._server.wait(10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
            self._server = None

    def run(self, spec: CaseSpec) -> dict[str, Any]:
        """Run one case, each pass in a fresh process; returns the merged measurements.

        A dict with ``status`` in ``ok | skipped | not_implemented | error``, ``reason`` (for the
        last three), ``info`` from the case's :class:`Prepared`, and per pass:

        * memory: ``mem`` (bytes) ``baseline`` = RSS after setup, ``peak`` = peak RSS of one call,
          ``delta = peak - baseline``, ``import`` = RSS before setup, ``peak_reset`` (whether the
          kernel's peak counter was reset after setup, so that ``peak`` is the call's own),
          ``allocator``; on the CPU ``tensors``, the call's peak of tensor memory (:func:`tensor_peak_bytes`);
        * time: ``time_s`` (:meth:`Timing.summary`) and ``mem["timed"]``: baseline, peak and delta
          over the warmup and timed calls under ``spec.allocator`` (includes heap fragmentation and, with
          "keep", freed memory kept for reuse), and ``allocator``.

        A failing pass stops the case. Never raises for a failing case: a crash, a timeout or an
        out-of-memory kill is reported as ``error``.
        """
        bad = [p for p in spec.passes if p not in PASSES]
        if bad or not spec.passes:
            raise ValueError(f"passes must be a non-empty subset of {PASSES}, got {spec.passes}")
        result: dict[str, Any] = {"status": "ok", "mem": {}}
        for name in spec.passes:
            res = self._run_pass(replace(spec, passes=(name,)))
            if res["status"] != "ok":
                return {**res, "pass": name}
            mem = res.pop("mem")
            result["mem"].update(mem if name == "memory" else {"timed": mem})
            result.update(res)
        return result

    def _run_pass(self, spec: CaseSpec) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="vitlab-case-") as tmp:
            spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
            with open(spec_path, "w") as f:
                json.dump({**asdict(spec), "target": target_path(spec.target)}, f)
            run = self._run_forked if self.isolation == "forkserver" else self._run_subprocess
            code = run(spec_path, out_path)
            if os.path.exists(out_path):
                with open(out_path) as f:
                    return json.load(f)
            if isinstance(code, str):
                return {"status": "error", "reason": code}
            if code is not None and code < 0:
                hint = " (killed: out of memory?)" if code == -9 else ""
                return {"status": "error", "reason": f"case process died with signal {-code}{hint}"}
            return {"status": "error", "reason": f"case process exited with code {code} and no result"}

    def _run_subprocess(self, spec_path: str, out_path: str) -> int | str:
        cmd = [sys.executable, "-m", "vitlab.measure.process", "--worker", spec_path, out_path]
        try:
            return subprocess.run(cmd, timeout=self.timeout).returncode
        except subprocess.TimeoutExpired:
            return f"timed out after {self.timeout:.0f} s"

    def _run_forked(self, spec_path: str, out_path: str) -> int | str:
        if self._server is None or self._server.poll() is not None:
            cmd = [sys.executable, "-m", "vitlab.measure.process", "--serve", ",".join(self.preload)]
            self._server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        server = self._server
        try:
            server.stdin.write(f"{spec_path}\t{out_path}\n")
            server.stdin.flush()
        except BrokenPipeError:
            started = ""
        else:
            started = server.stdout.readline()  # "pid N"
        if not started:
            return "the case server died (see its error above)"
        pid = int(started.split()[1])
        timed_out = False
        if not select.select([server.stdout], [], [], self.timeout)[0]:
            os.kill(pid, signal.SIGKILL)  # the case process this runner started
            timed_out = True
        line = server.stdout.readline()  # "exit CODE"
        if timed_out:
            return f"timed out after {self.timeout:.0f} s"
        return int(line.split()[1]) if line else "the case server died"


def device_figures(mem: dict[str, Any]) -> dict[str, Any]:
    """The memory figures of the device a case ran on: the GPU allocator's (``mem["cuda"]``) for a GPU case,
    with the host's figures under ``"host"``; ``mem`` itself for a CPU case."""
    return {**mem["cuda"], "host": {k: v for k, v in mem.items() if k != "cuda"}} if "cuda" in mem else mem


def run_case(spec: CaseSpec, *, isolation: str = "forkserver", timeout: float = 600.0) -> dict[str, Any]:
    """Run one case in a fresh process (see :meth:`CaseRunner.run`)."""
    with CaseRunner(isolation, timeout) as runner:
        return runner.run(spec)


def _serve(preload: list[str]) -> int:
    """The fork server: import ``preload`` once, then fork one child per case read from stdin."""
    _die_with_parent()
    for name in preload:
        importlib.import_module(name)
    out = sys.stdout
    for line in sys.stdin:
        spec_path, out_path = line.rstrip("\n").split("\t")
        pid = os.fork()
        if pid == 0:  # the case process: its prints must not reach the protocol pipe
            _die_with_parent()
            os.dup2(2, 1)
            code = 1
            try:
                code = _worker(spec_path, out_path)
            finally:
                os._exit(code)
        out.write(f"pid {pid}\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(f"exit {os.waitstatus_to_exitcode(status)}\n")
        out.flush()
    return 0


def _die_with_parent() -> None:
    """Linux: be killed when the parent dies, so that an interrupted benchmark leaves no case running."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: nothing to do
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def target_path(target: Callable[..., Any] | str) -> str:
    """The import path ``"package.module:function"`` of a case's setup function."""
    if isinstance(target, str):
        return target
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not module or module == "__main__" or "." in name or "<" in name:
        raise ValueError(f"a case target must be a module-level function importable from its module, got {target!r}")
    return f"{module}:{name}"


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"case target must look like 'package.module:function', got {target!r}")
    return getattr(importlib.import_module(module), name)


def _measure_in_this_process(spec: CaseSpec) -> dict[str, Any]:
    """One pass of :meth:`CaseRunner.run` in this process (``spec.passes`` names it)."""
    (name,) = spec.passes
    if name == "memory":
        tight = return_freed_memory()  # before setup, so that setup leaves no free heap
    elif spec.allocator == "keep":
        keep_freed_memory()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    import_rss = current_rss_bytes() or 0
    try:
        prepared = _resolve(spec.target)(**spec.params)
    except CaseSkipped as e:
        return {"status": "skipped", "reason": str(e)}
    except NotImplementedError as e:
        return {"status": "not_implemented", "reason": str(e) or "not implemented"}
    if not isinstance(prepared, Prepared):
        prepared = Prepared(prepared)
    _release(prepared)
    device = torch.device(prepared.device)
    reset_peak_memory(device)
    gpu_baseline = device_memory(device)
    reset = reset_peak_rss()
    baseline = current_rss_bytes() or 0  # 0 without /proc: the peak is all we know
    out: dict[str, Any] = {"status": "ok", "info": prepared.info}
    try:
        if name == "memory":
            prepared.fn()
        else:
            timing = time_callable(
                prepared.fn, warmup=spec.warmup, repeats=spec.repeats, max_time=spec.max_time, device=device
            )
            out["time_s"] = timing.summary()
    except NotImplementedError as e:
        return {"status": "not_implemented", "reason": str(e) or "not implemented", "info": prepared.info}
    # The kernel counts RSS per thread in batches of a few pages and folds them in lazily, so VmHWM can read a
    # few KiB below the RSS read just after the reset: the call's peak is at least that baseline by definition.
    peak = max(peak_rss_bytes(), baseline)
    out["mem"] = {"baseline": baseline, "peak": peak, "delta": peak - baseline}
    out["mem"]["allocator"] = allocator_policy()
    if gpu_baseline is not None:  # the GPU allocator's peak over the call(s): the memory a GPU case needs
        gpu = device_memory(device)
        out["mem"]["cuda"] = {"baseline": gpu_baseline["allocated"], "peak": gpu["peak"]}
        out["mem"]["cuda"]["delta"] = gpu["peak"] - gpu_baseline["allocated"]
    if name == "memory":
        allocator = "glibc, fixed mmap threshold 128 KiB" if tight else "default"
        out["mem"].update(**{"import": import_rss}, peak_reset=reset, allocator=allocator)
        if device.type == "cpu":  # after the RSS figures, which the profiler's own memory would blur
            _release(prepared)
            out["mem"]["tensors"] = tensor_peak_bytes(prepared.fn)
    return out


def _release(prepared: Prepared) -> None:
    if prepared.reset is not None:
        prepared.reset()
    gc.collect()


def _measure_guarded(spec: CaseSpec) -> dict[str, Any]:
    try:
        return _measure_in_this_process(spec)
    except Exception as e:
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"status": "error", "reason": last, "traceback": traceback.format_exc()}


def _worker(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        result = _measure_guarded(CaseSpec(**json.load(f)))
    tmp = out_path + ".part"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)  # the parent sees a complete file or none
    return 0


# --------------------------------------------------------------------------- calibration case


def allocation_case(mb: float = 200.0, tensor: bool = False) -> Prepared:
    """A case whose work allocates and touches ``mb`` MiB (a bytearray, or a tensor), then frees it (to check the
    measurement)."""
    n = int(mb * MB)

    def work() -> None:
        buf = torch.ones(n, dtype=torch.uint8) if tensor else bytearray(b"\x01") * n  # every page written
        del buf

    return Prepared(work, {"allocates_bytes": n})


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m vitlab.measure.process", description=doc)
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", metavar="MODULES", help=argparse.SUPPRESS)
    parser.add_argument(
        "--self-check",
        type=float,
        metavar="MB",
        nargs="?",
        const=200.0,
        help="allocate MB MiB in a fresh process and print the measured peak",
    )
    parser.add_argument("--isolation", choices=ISOLATIONS, default="forkserver")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(*args.worker)
    if args.serve is not None:
        return _serve([m for m in args.serve.split(",") if m])
    if args.self_check is not None:
        spec = CaseSpec(allocation_case, {"mb": args.self_check}, repeats=1)
        res = run_case(spec, isolation=args.isolation)
        if res["status"] != "ok":
            print(f"self-check failed: {res.get('reason')}")
            return 1
        m = res["mem"]
        print(
            f"allocated {args.self_check:.0f} MiB; measured peak - baseline = {m['delta'] / MB:.1f} MiB "
            f"(baseline {m['baseline'] / MB:.1f} MiB, peak {m['peak'] / MB:.1f} MiB, "
            f"peak counter reset: {m['peak_reset']})"
        )
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    # run as the package module, not as __main__, so the classes a case raises or returns
    # (CaseSkipped, Prepared) are the ones this code checks against
    from .process import main as _main

    sys.exit(_main())
