"""Multi-head self-attention (Vaswani et al.; ViT/DeiT's token mixer).

``softmax(Q Kᵀ / sqrt(d_h)) V`` per head, through
``F.scaled_dot_product_attention`` unless the attention map is asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.linear import fused_linear
from ..ops.softmax import softmax_keeping_dtype
from ..ops.switch import eager_fast_path, fx_tracing
from .base import SOFTMAX, TokenLayout, TokenMixer, check_divisible, merge_heads


def attention_map(q: Tensor, k: Tensor, scale: float, causal: bool = False, bias: Tensor | None = None) -> Tensor:
    """Explicit ``softmax(q kᵀ · scale + bias)`` over keys, (B, H, N, N), in fp32 internally.

    Shared by every mixer that needs the map itself (re-attention, refiner,
    analysis). ``softmax`` subtracts the row max, so large logits are safe.

    Half-precision logits: the plain path normalises an fp32 copy and rounds the result, and its backward pass
    keeps that fp32 map (under CUDA autocast ``softmax`` runs in fp32 too). The fast path (eager, the switch on)
    calls the softmax kernel that sums in fp32 and writes the map once in the logits' dtype
    (:func:`~vitlab.ops.softmax.softmax_keeping_dtype`): the same values to one rounding, and the backward
    pass keeps a half-precision map, a third of the plain path's map bytes. The maps of re-attention and the
    refiner are the largest tensors those models keep.
    """
    logits = (q * scale) @ k.transpose(-2, -1)
    if bias is not None:  # additive logits, e.g. relative positions
        logits = logits + bias
    if causal:
        n = logits.shape[-1]
        mask = logits.new_ones(n, n, dtype=bool).triu(1)
        logits = logits.masked_fill(mask, float("-inf"))
    # half-precision logits are normalised in fp32, as SDPA's kernels do
    low = not fx_tracing() and logits.dtype in (torch.float16, torch.bfloat16)  # fx: a symbol without a dtype
    if low and eager_fast_path():  # fp32 sums, one rounding to the logits' dtype, and no fp32 map kept
        return softmax_keeping_dtype(logits).to(q.dtype)
    return logits.softmax(dim=-1, dtype=torch.float32 if low else None).to(q.dtype)


def attention_softmax_flops(batch: int, heads: int, queries: int, keys: int) -> int:
    """Elementwise FLOPs of ``softmax(Q Kᵀ · s)``: the scale (1) and the softmax (5) per map element (the
    products are MACs)."""
    return (1 + SOFTMAX) * batch * heads * queries * keys


class HeadMix(nn.Conv2d):
    """1×1 convolution over the head axis of maps (B, H, N, N): ``out_g = Σ_h W[g, h, 0, 0] A_h (+ b_g)``.

    Used by re-attention and the refiner's expansion / reduction. It is a Conv2d
    (so state-dict keys and shapes are the official ones) computed as a Linear
    over a heads-last view, about 3x faster than a 1×1 conv on CPU. The result
    has channels-last strides, which the depth-wise conv and BatchNorm that
    follow handle natively (and faster).
    """

    def __init__(self, in_heads: int, out_heads: int, bias: bool = True) -> None:
        super().__init__(in_heads, out_heads, 1, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.permute(0, 2, 3, 1), self.weight[:, :, 0, 0], self.bias).permute(0, 3, 1, 2)


class Attention(TokenMixer):
    """Multi-head self-attention with a fused ``qkv`` projection (timm/DeiT layout).

    ``out = proj(concat_h softmax(Q_h K_hᵀ · s) V_h)``, ``s = qk_scale or d_h^-1/2``.
    The fast path is SDPA; ``return_aux=True`` (or ``fused=False``) takes the
    explicit path, which returns the same output and the map ``aux["attn"]``.
    ``causal=True`` masks keys after the query (for autoregressive models); a causal mixer decodes
    incrementally from a key/value cache (:meth:`step`).
    """

    flops_label = "attention softmax"

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        causal: bool = False,
        fused: bool = True,
    ) -> None:
        super().__init__(dim)
        head_dim = check_divisible("Attention", dim, num_heads)
        self.num_heads = num_heads
        self.scale = qk_scale or head_dim**-0.5
        self.causal = causal
        self.fused = fused
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def qkv_heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, N, C) -> q, k, v each (B, H, N, d_h)."""
        b, n, c = x.shape
        qkv = fused_linear(self.qkv, x).view(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        # unbind, not qkv[0], qkv[1], qkv[2]: its backward stacks the three gradients into one tensor, where three
        # selects would each zero-fill a full-size gradient and add them up (3 fills, 2 adds, ~20% of attention)
        q, k, v = qkv.unbind(0)
        return q, k, v

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        # q, k, v live only in this call's arguments: they are freed before the projection allocates its output
        # (without autograd, 4 activation-sized buffers at the peak instead of 5)
        out, aux = self.attend_heads(*self.qkv_heads(x), return_aux)
        return self.project(out), aux

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, return_aux: bool, bias: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``proj(merge_h(softmax(q kᵀ s + bias) v))`` (:meth:`attend_heads`, then :meth:`project`). Variants
        that change only q, k, v or add logits (:mod:`vitlab.mixers.attention_variants`) call this."""
        out, aux = self.attend_heads(q, k, v, return_aux, bias)
        return self.project(out), aux

    def project(self, out: Tensor) -> Tensor:
        """The output projection of the heads' results ``out`` (B, H, N, d_h) -> (B, N, C)."""
        return self.proj_drop(fused_linear(self.proj, merge_heads(out)))

    def attend_heads(
        self, q: Tensor, k: Tensor, v: Tensor, return_aux: bool, bias: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``softmax(q kᵀ s + bias) v`` per head (B, H, N, d_h): SDPA unless the map is asked for (the explicit
        path computes the same function and returns the map as ``aux["attn"]``)."""
        aux: dict[str, Tensor] = {}
        # torch's ONNX decomposition of SDPA with an additive bias fails with autograd on (torch.onnx.export's
        # default): an export with a bias records the explicit form, the same function
        exported_bias = bias is not None and torch.compiler.is_exporting()
        if self.fused and not return_aux and not exported_bias and not self._explicit_trains_faster(q):
            drop = self.attn_drop.p if self.training else 0.0
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=drop, is_causal=self.causal, scale=self.scale
            )
        else:
            attn = attention_map(q, k, self.scale, self.causal, bias)
            aux["attn"] = attn
            out = self.attn_drop(attn) @ v
        return out, aux

    def _explicit_trains_faster(self, q: Tensor) -> bool:
        """Whether the explicit map beats SDPA for this call: training on the CPU with short sequences, where
        SDPA's backward pays per (batch, head) block (TNT's inner attention, 16 words of 6-channel heads: 1.27x
        faster explicit, forward + backward; N = 32 1.6x, N = 64 1.35x; N = 197 SDPA is as fast or faster). Its
        map is (N x N) per head, no bigger than the activations at these lengths. Not with attention dropout,
        whose random mask would differ from SDPA's."""
        return (
            eager_fast_path()
            and q.shape[-2] <= 64
            and q.device.type == "cpu"
            and torch.is_grad_enabled()
            and q.requires_grad
            and (self.attn_drop.p == 0 or not self.training)
        )

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        return attention_softmax_flops(batch, self.num_heads, tokens, tokens)

    def init_state(self, batch: int, max_len: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """The key and value cache, (B, H, max_len, d_h) each."""
        shape = (batch, self.num_heads, max_len, self.dim // self.num_heads)
        return like.new_zeros(shape), like.new_zeros(shape)

    def step(self, x: Tensor, t: int, state: tuple[Tensor, Tensor]) -> Tensor:
        """Causal attention at position t: the new query against the cached keys and values of positions <= t."""
        keys, values = state
        q, k, v = self.qkv_heads(x[:, None])  # (B, H, 1, d_h)
        keys[:, :, t : t + 1], values[:, :, t : t + 1] = k, v
        out = F.scaled_dot_product_attention(q, keys[:, :, : t + 1], values[:, :, : t + 1], scale=self.scale)
        return self.proj(merge_heads(out))[:, 0]
