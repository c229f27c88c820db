"""External attention: EAMLP-7 / 14 / 19 (T2T-ViT with external attention everywhere), its T2T-ViT-7 / 14
baselines, EAMLP-7 with BatchNorm, ``eamlp_mini``, and the small study rows of EA's normalisation, BatchNorm and
memory size and of double-normalised self-attention."""

from __future__ import annotations

from typing import Any

from ..registry import ModelConfig, register
from ._shared import MINI_EVAL

EA = "Guo et al. 2021, Beyond Self-attention: External Attention using Two Linear Layers"
T2T = "Yuan et al. 2021, Tokens-to-Token ViT: Training Vision Transformers from Scratch on ImageNet"

T2T_EVAL = dict(crop_pct=0.9, interpolation="bicubic")  # EANet EAMLP/models/t2t_vit.py default_cfgs
EAMLP_7_WEIGHTS = "MenghaoGuo/EANet EAMLP/EAMLP_7_384/model_best.pth.tar"
# the small EAMLP: soft splits k/s/p 3/2/1, 3/2/1, 3/1/1 (an 8x8 grid at 32 px, 7x7 at 28)
EAMLP_MINI = dict(
    img_size=32,
    embed_dim=64,
    depth=4,
    num_heads=2,
    mlp_ratio=4.0,
    token_dim=32,
    soft_split=((3, 2, 1), (3, 2, 1), (3, 1, 1)),
)


def t2t_mini(name: str, paper: str, source: str, **kw: Any) -> ModelConfig:
    """A small study row: ``eamlp_mini``'s T2T-ViT with the switches ``kw`` of one ablation line."""
    return ModelConfig(name, "t2t", {**EAMLP_MINI, **kw}, paper, "vitlab small study row: " + source)


_rows: list[ModelConfig] = []

# --- EAMLP: T2T-ViT with external attention everywhere (EA token layers S=128, multi-head EA blocks) ---
# The position table is a fixed sinusoid recomputed for the input's token count, so every row runs at any size.
# top-1: EAMLP-7 at 384 px from the official README (its checkpoint is in the repository); EAMLP-14/19 from the
# Vision Permutator README's comparison (no official checkpoint)
for depth, dim, heads, mlp, params, top1 in (
    (7, 256, 4, 2.0, 6.10, 71.7),
    (14, 384, 6, 3.0, 29.80, 78.9),
    (19, 448, 7, 3.0, 54.47, 79.4),
):
    _rows.append(
        ModelConfig(
            f"eamlp_{depth}",
            "t2t",
            dict(img_size=384 if depth == 7 else 224, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=mlp),
            EA,
            f"MenghaoGuo/EANet EAMLP/models/t2t_vit.py T2t_vit_{depth} (external attention)",
            params,
            notes=(
                "official input 384 (EAMLP_7_384/args.yaml, 71.7% top-1); img_size=224 gives the same parameters"
                if depth == 7
                else "top-1 quoted by the Vision Permutator README, not by the EANet repository"
            ),
            top1=top1,
            weights_url=EAMLP_7_WEIGHTS if depth == 7 else "",
            **T2T_EVAL,
        )
    )

# --- T2T-ViT-7/14, EAMLP's baselines (official: Performer token layers, self-attention blocks without qkv bias) --
for depth, dim, heads, mlp, params, macs in ((7, 256, 4, 2.0, 4.26, 1.15), (14, 384, 6, 3.0, 21.47, 4.78)):
    _rows.append(
        ModelConfig(
            f"t2t_vit_{depth}",
            "t2t",
            dict(
                embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=mlp, token_mixer="performer", mixer="attention"
            ),
            T2T,
            f"yitu-opensource/T2T-ViT models/t2t_vit.py T2t_vit_{depth} (tokens_type='performer')",
            params,
            macs,
            notes=f"paper {'4.3M / 1.1G' if depth == 7 else '21.5M / 4.8G'}; EAMLP-{depth}'s baseline",
        )
    )

# --- full-size ablation row -----------------------------------------------------------------------------------
_rows.append(
    ModelConfig(
        "eamlp_7_bn",
        "t2t",
        dict(img_size=384, embed_dim=256, depth=7, num_heads=4, mlp_ratio=2.0, norm="batch"),
        EA,
        "EA paper (EAMLP-7 with BatchNorm in place of LayerNorm, as MoCo v3)",
        6.10,
        notes="Decision E4: BatchNorm replaces both LayerNorms of every backbone block",
    )
)

# --- small variant for CPU training (32 px) ---------------------------------------------------------------------
_rows.append(
    ModelConfig(
        "eamlp_mini",
        "t2t",
        dict(EAMLP_MINI),
        EA,
        "vitlab: small EAMLP (soft splits k/s/p 3/2/1, 3/2/1, 3/1/1: an 8x8 grid at 32 px, 7x7 at 28)",
        notes="the official 7/4/2 first split would leave a 2x2 grid at 32 px; stride 1 comes last so that the "
        "token layers see 256 and 64 tokens instead of 1024 and 256 (a third fewer MACs)",
        **MINI_EVAL,
    )
)

# --- small study rows (docs/studies.md): softmax-only vs double normalisation (EA and self-attention),
# BatchNorm, memory slots; the T2T-ViT baseline -----------------------------------------------------------------
_rows += [
    t2t_mini(
        "eamlp_softmax_mini",
        EA,
        "EA with the softmax over the tokens only (no l1 step)",
        mixer=("external_mh", dict(norm="softmax")),
    ),
    t2t_mini("eamlp_bn_mini", EA, "EAMLP with BatchNorm in the blocks", norm="batch"),
    *[
        t2t_mini(f"eamlp_s{s}_mini", EA, f"EA with {s} memory slots", mixer=("external_mh", dict(memory_size=s)))
        for s in (8, 32, 256)
    ],
    t2t_mini(
        "t2t_vit_mini",
        T2T,
        "T2T-ViT (Performer token layers, self-attention)",
        token_mixer="performer",
        mixer="attention",
    ),
    t2t_mini(
        "t2t_vit_dn_mini",
        EA,
        "T2T-ViT with double-normalised self-attention",
        token_mixer="performer",
        mixer="attention_double_norm",
    ),
]

register(*_rows)
