"""AFT Table 7's lambda networks have the paper's parameter counts (Lambda tiny 4.8M, small 17.7M): the output
projection and DeiT's position table are what the counts imply (the arithmetic: vitlab.mixers.lambda_layer)."""

from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.mixers import LambdaLayer


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(
    ("name", "paper", "exact"), [("lambda_tiny", 4.8, 4_820_584), ("lambda_small", 17.7, 17_682_472)]
)
def test_the_counts_round_to_the_papers(name, paper, exact):
    with torch.device("meta"):
        model = vitlab.create_model(name)
    assert count(model) == exact and round(count(model) / 1e6, 1) == paper
    assert vitlab.models.get_config(name).params_m == paper


@pytest.mark.parametrize(("dim", "heads", "per_block"), [(192, 3, 36_464), (384, 6, 79_568)])
def test_the_layer_count_is_the_docstring_sum(dim, heads, per_block):
    """W_Q d·16h + W_K d·16 + W_V d·v + BN 2·16h + 2v + R 27·27·16, and W_O d² + d with the projection."""
    bare = LambdaLayer(dim, num_heads=heads, key_dim=16, max_distance=13, prefix_embedding=False, out_proj=False)
    v = dim // heads
    assert count(bare) == per_block == dim * 16 * heads + dim * 16 + dim * v + 2 * 16 * heads + 2 * v + 27 * 27 * 16
    full = LambdaLayer(dim, num_heads=heads, key_dim=16, max_distance=13, prefix_embedding=False)
    assert count(full) - count(bare) == dim * dim + dim


def test_only_the_projection_and_the_table_together_give_both_counts():
    """The alternatives of the docstring: without the projection, or without the table, one count misses."""
    rounded = {}
    for proj in (False, True):
        for table in ("none", "learned"):
            counts = []
            for name in ("lambda_tiny", "lambda_small"):
                mixer = ("lambda", dict(key_dim=16, max_distance=13, prefix_embedding=False, out_proj=proj))
                with torch.device("meta"):
                    model = vitlab.create_model(name, mixer=mixer, pos_embed=table)
                counts.append(round(count(model) / 1e6, 1))
            rounded[proj, table] = tuple(counts)
    assert rounded == {
        (False, "none"): (4.3, 15.8),
        (False, "learned"): (4.4, 15.9),
        (True, "none"): (4.8, 17.6),
        (True, "learned"): (4.8, 17.7),
    }


def test_the_projection_is_applied_last():
    torch.manual_seed(0)
    layer = LambdaLayer(16, num_heads=2, key_dim=4, max_distance=2, prefix_embedding=False).eval()
    bare = LambdaLayer(16, num_heads=2, key_dim=4, max_distance=2, prefix_embedding=False, out_proj=False).eval()
    bare.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("proj.")})
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(layer(x), layer.proj(bare(x)))
    assert "out_proj=True" in repr(layer)
