"""Named causal LMs of the efficient-attention baselines in AFT's Tables 2 and 4, and tiny ones for tests.

Each row is a :class:`~vitlab.tasks.lm.model.CausalLM` argument set and a note with the paper's figures (train / test
bits per character or per dimension; training speed in iterations per second and memory in GB per GPU, batch
128 (Table 4) or 32 (Table 2) on 8 V100s). Where the paper does not give a baseline's own settings (hash rounds,
number of random features, stride), the choice here is noted as ours.
"""

from __future__ import annotations

from typing import Any

_ENWIK8_BASE = {"vocab_size": 256, "max_len": 1024, "dropout": 0.1, "dim": 512, "depth": 12, "heads": 8}
_CIFAR = {"vocab_size": 256, "max_len": 3072, "dropout": 0.1}
# the 32 x 32 x 3 image as 32 rows of 96 sub-pixels (the Image Transformer's layout), with the block shapes of
# tensor2tensor's CIFAR-10 local-2D set (imagetransformer2d_base_8l_8_32_big; the paper does not give them)
_LOCAL2D_CIFAR = {"row_len": 96, "query_shape": (8, 16), "memory_flange": (0, 32)}
_TINY = {"vocab_size": 256, "max_len": 256, "dim": 32, "depth": 2, "heads": 2, "dropout": 0.0}

#: the causal mixer kinds of the baselines (all in :data:`vitlab.mixers.BASELINE_MIXERS`; the lambda layer is
#: not causal and has no LM)
BASELINE_KINDS = (
    "linear_attention",
    "performer",
    "synthesizer_dense",
    "synthesizer_random",
    "local_attention",
    "strided_attention",
    "local2d_attention",
    "lsh_attention",
)

BASELINE_ROWS: dict[str, tuple[dict[str, Any], str]] = {
    # enwik8 (Table 4): the base Transformer's shape L=12, d=512, h=8, T=1024
    "reformer_enwik8": (
        {**_ENWIK8_BASE, "mixer": ("lsh_attention", {"buckets": 16, "rounds": 2, "chunk_size": 64})},
        "Table 4: Reformer, L=12, d=512, h=8: 1.04 / 1.195 bpc, 1.05 it/s, 20.9 GB "
        "(16 buckets, chunks of 64, 2 hash rounds: ours)",
    ),
    "synthesizer_enwik8": (
        {**_ENWIK8_BASE, "mixer": "synthesizer_dense"},
        "Table 4: Synthesizer (dense), L=12, d=512, h=8: 0.994 / 1.298 bpc, 1.49 it/s, 29.9 GB",
    ),
    "linear_transformer_enwik8": (
        {**_ENWIK8_BASE, "mixer": "linear_attention"},
        "Table 4: Linear Transformer, L=12, d=512, h=8: 0.981 / 1.207 bpc, 1.46 it/s, 10.6 GB",
    ),
    "performer_enwik8": (
        {**_ENWIK8_BASE, "mixer": ("performer", {"redraw_every": 1000})},
        "Table 4: Performer, L=12, d=512, h=8: 1.002 / 1.199 bpc, 1.44 it/s, 10.1 GB "
        "(m = d_h ln d_h features, redrawn every 1000 steps: ours)",
    ),
    # CIFAR-10 (Table 2), T = 3072 sub-pixels
    "sparse_strided_cifar": (
        {**_CIFAR, "dim": 256, "depth": 128, "heads": 2, "mixer": ("strided_attention", {"stride": 96})},
        "Table 2: Sparse Transformer strided, L=128, d=256, h=2: 2.80 bits/dim test (stride = one image row "
        "of 96 sub-pixels: ours)",
    ),
    "image_transformer_local_cifar": (
        {**_CIFAR, "dim": 512, "depth": 12, "heads": 4, "mixer": ("local_attention", {"window": 256})},
        "Table 2 shape (L=12, d=512, h=4) with the Image Transformer's local 1-D attention: a window of 256 "
        "sub-pixels (Table 2's figures are local2d's: image_transformer_local2d_cifar)",
    ),
    "image_transformer_local2d_cifar": (
        {**_CIFAR, "dim": 512, "depth": 12, "heads": 4, "mixer": ("local2d_attention", _LOCAL2D_CIFAR)},
        "Table 2: Image Transformer local2d, L=12, d=512, h=4: 2.90 bits/dim test, 1.61 it/s, 22.3 GB "
        "(rows of 96 sub-pixels, query blocks 8 x 16, memory 32 more columns either side: tensor2tensor's set)",
    ),
    # tiny models for tests and quick CPU runs
    "tiny_linear_transformer": ({**_TINY, "mixer": "linear_attention"}, "tests: Linear Transformer"),
    "tiny_performer": ({**_TINY, "mixer": ("performer", {"num_features": 32})}, "tests: Performer"),
    "tiny_synthesizer": ({**_TINY, "mixer": "synthesizer_dense"}, "tests: Synthesizer (dense)"),
    "tiny_synthesizer_random": ({**_TINY, "mixer": "synthesizer_random"}, "tests: Synthesizer (random)"),
    "tiny_local_attention": ({**_TINY, "mixer": ("local_attention", {"window": 8})}, "tests: local attention"),
    "tiny_strided_attention": ({**_TINY, "mixer": ("strided_attention", {"stride": 8})}, "tests: strided"),
    "tiny_local2d_attention": (
        {**_TINY, "mixer": ("local2d_attention", {"row_len": 6, "query_shape": (2, 3), "memory_flange": (1, 2)})},
        "tests: Image Transformer local2d",
    ),
    "tiny_reformer": (
        {**_TINY, "mixer": ("lsh_attention", {"buckets": 4, "rounds": 2, "chunk_size": 8})},
        "tests: Reformer LSH attention",
    ),
}
