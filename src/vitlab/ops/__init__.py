"""The kernel layer: every fast path vitlab has, below the papers' modules, behind one switch.

The mixers (:mod:`vitlab.mixers`) read as their papers' equations and call the operations here:

* :mod:`.linear` -- linear layers with GELU or residual epilogues, in oneDNN on CPUs where it runs and pays
  (:mod:`.onednn`, decided by :mod:`.probe`);
* :mod:`.aft` -- the AFT cores, exact for any magnitude, with :mod:`.aft_banded` (AFT-local's band),
  :mod:`.aft_conv` and :mod:`.aft_simple` (closed-form backward passes) and the decoding states;
* :mod:`.triton_aft`, :mod:`.triton_aft_simple` -- AFT-full/local and AFT-simple as Triton kernels, taken on CUDA
  (:mod:`.triton_support` says where they run);
* :mod:`.double_norm` -- external attention's double normalisation;
* :mod:`.head_mix_norm` -- the head mix + training BatchNorm of re-attention and the refiner;
* :mod:`.fold` -- BatchNorm folded into a convolution in eval mode;
* :mod:`.triton_double_norm`, :mod:`.triton_head_mix` -- the map chains of external attention, re-attention and
  the refiner as Triton kernels on a GPU (:mod:`.triton_support` says where they run).

Every fast path computes the same function as the plain operations (the tests hold them equal), and
``set_fast_paths(False)`` (or ``VITLAB_FAST_PATHS=0``) turns them all off. :func:`decisions` reports what the
probes decided on this machine.
"""

from __future__ import annotations

from .probe import decisions
from .switch import fast_paths, fast_paths_enabled, set_fast_paths

__all__ = ["decisions", "fast_paths", "fast_paths_enabled", "set_fast_paths"]
