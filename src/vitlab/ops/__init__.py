"""The kernel layer: every fast path vitlab has, below the papers' modules, behind one switch.

The mixers (:mod:`vitlab.mixers`) read as their papers' equations and call the operations here, one module
each:

* :mod:`.switch` -- the one switch of every fast path and the context its decisions read;
* :mod:`.probe` -- which hardware-dependent paths this process takes, decided once by running them;
* :mod:`.linear` -- linear layers with GELU or residual epilogues, in oneDNN on CPUs where it runs and pays
  (:mod:`.onednn`);
* :mod:`.softmax` -- the attention map's softmax for half-precision logits (fp32 sums);
* :mod:`.aft` -- the AFT cores, exact for any magnitude, built on :mod:`.aft_banded` (AFT-local's band),
  :mod:`.aft_conv` (AFT-conv's window sums) and :mod:`.aft_simple` (closed-form backward passes);
  :mod:`.aft_decode` -- causal AFT's one-token decoding states;
* :mod:`.block_sparse` -- fixed-pattern sparse attention (local, strided, 2-D local) block by block, in O(N·s)
  time and memory instead of a mask over the dense N x N product;
* :mod:`.double_norm` -- external attention's double normalisation;
* :mod:`.head_mix_norm` -- the head mix + training BatchNorm of re-attention and the refiner, with
  :mod:`.head_mix_terms` (what its eager and Triton forms share);
* :mod:`.row_norm` -- training BatchNorm on channels-last maps as (rows, channels) matrices (the refiner's
  expanded maps), with per-channel sums that run at memory speed for any channel count;
* :mod:`.fold` -- BatchNorm folded into a convolution in eval mode;
* :mod:`.patchify` -- a patch projection (convolution with kernel = stride) as one product over the patches;
* :mod:`.soft_split` -- T2T's soft split (overlapping windows as tokens) as one gather, its adjoint as backward;
* :mod:`.triton_aft`, :mod:`.triton_aft_simple`, :mod:`.triton_aft_conv`, :mod:`.triton_aft_decode` -- the AFT
  family as Triton kernels (AFT-full/local, AFT-simple, AFT-conv's windows, the decoding step);
* :mod:`.triton_double_norm`, :mod:`.triton_head_mix` -- the map chains of external attention, re-attention and
  the refiner as Triton kernels;
* :mod:`.triton_support` -- where the Triton kernels run (CUDA tensors; CPU tensors in Triton's interpreter).

Every fast path computes the same function as the plain operations (the tests hold them equal), and
``set_fast_paths(False)`` (or ``VITLAB_FAST_PATHS=0``) turns them all off. :func:`decisions` reports what the
probes decided on this machine.
"""

from __future__ import annotations

from .probe import decisions
from .switch import fast_paths, fast_paths_enabled, set_fast_paths

__all__ = ["decisions", "fast_paths", "fast_paths_enabled", "set_fast_paths"]
