"""Key maps from the reference implementations' state_dicts to vitlab's.

A conversion has three steps, all on plain ``{key: tensor}`` dicts:

1. ``DROPS[source]``: tensors the reference keeps but never uses are dropped,
   each with the reason (TNT's frozen ``outer_tokens``, EAMLP's fixed sinusoid table);
2. ``TRANSFORMS[source]``: value transforms under the reference's own names
   (TNT's separate ``qk`` and ``v`` Linears fused into one ``qkv``, timm TNT's
   ``pixel_pos`` layout, EAMLP's two spellings of the token-layer memories);
3. ``KEY_RULES[source]``: regex rewrites; the **first** rule whose pattern matches
   a key rewrites it (``re.sub``), keys no rule matches keep their name.

:func:`convert_state` runs the three and says what it did; :func:`rename_keys`
returns the converted dict only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from ..mixers.refiner import OFFICIAL_KEY_PREFIXES as REFINER_PREFIXES

Rule = tuple[str, str]
Transform = Callable[[dict[str, Tensor]], tuple[dict[str, Tensor], list[str]]]

#: what each source is (the ``--source`` choices of ``vitlab convert``)
SOURCES: dict[str, str] = {
    "timm_vit": "timm VisionTransformer (ViT / DeiT, also DeiT-style CPVT blocks)",
    "deit": "facebookresearch/deit checkpoints (timm names; distilled: dist_token, head_dist)",
    "tnt_huawei": "huawei-noah/Efficient-AI-Backbones tnt_pytorch/tnt.py (official TNT)",
    "tnt_timm": "timm tnt.py, legacy=False (tnt_s_patch16_224 / tnt_b_patch16_224)",
    "cpvt": "DeiT-style CPVT: timm blocks + Twins PosCNN as pos_block (paper Algorithm 1)",
    "twins_peg": "Meituan-AutoML/Twins gvt.py PosCNN on its own",
    "twins_cpvtv2": "Meituan-AutoML/Twins gvt.py CPVTV2 (PCPVT pcpvt_*_v0, the pyramid with PEGs)",
    "eanet": "MenghaoGuo/EANet model_torch.py External_attention (the module for CNN feature maps)",
    "deepvit": "zhoudaquan/dvit_repo DeepVisionTransformer (official DeepViT)",
    "refiner": "zhoudaquan/Refiner_ViT Refiner_ViT (official Refined-ViT)",
    "eamlp": "MenghaoGuo/EANet EAMLP/models t2t_vit.py (official EAMLP)",
    "vitlab": "vitlab's own names (a state_dict or safetensors file written by vitlab)",
}

_BLOCK = r"^(blocks\.\d+\.)"
_VIT: list[Rule] = [(_BLOCK + r"attn\.", r"\1mixer.")]


def _stem(convs: int) -> list[Rule]:
    """Official CNN stems (``PatchEmbed_cnn`` / ``PatchEmbed_CNN``): conv{i}/bn{i} -> our ``stem`` Sequential
    (conv, BN, ReLU per stage, so stage i sits at 3i, 3i + 1)."""
    rules: list[Rule] = []
    for i in range(convs):
        rules += [
            (rf"^patch_embed\.conv{i + 1}\.", f"patch_embed.stem.{3 * i}."),
            (rf"^patch_embed\.bn{i + 1}\.", f"patch_embed.stem.{3 * i + 1}."),
        ]
    return rules


def _prefixed(prefix: str, pairs: tuple[tuple[str, str], ...]) -> list[Rule]:
    """Prefix renames ``old -> new`` under an optional ``blocks.N.`` (TNT: the same names at model and block level)."""
    return [(rf"^((?:{prefix})?){re.escape(old)}", rf"\1{new}") for old, new in pairs]


_TNT_OPT_BLOCK = r"blocks\.\d+\."
KEY_RULES: dict[str, list[Rule]] = {
    "timm_vit": _VIT,
    "deit": _VIT,
    # Twins' PosCNN: proj is Sequential(conv) there
    "twins_peg": [(r"^proj\.0\.", "proj.")],
    # Twins' CPVTV2 pyramid: blocks per stage keep their names, attn -> mixer, the stage PEGs -> pegs
    "twins_cpvtv2": [
        (r"^(blocks\.\d+\.\d+\.)attn\.", r"\1mixer."),
        (r"^pos_block\.(\d+)\.proj\.0\.", r"pegs.\1.proj."),
    ],
    # EANet: the memories linear_0 / linear_1 (1-D convolutions, reshaped by _eanet_memories) -> ea.mk / ea.mv
    "eanet": [(r"^linear_0\.", "ea.mk."), (r"^linear_1\.", "ea.mv.")],
    # re-attention keeps the official submodule names (reatten_matrix, var_norm)
    "deepvit": [*_VIT, *_stem(2)],
    # Refined-ViT: DLA submodules renamed, the MLP's scale_channel is the MLP LayerScale
    "refiner": [
        *[(_BLOCK + rf"attn\.{re.escape(old)}", rf"\1mixer.{new}") for old, new in REFINER_PREFIXES.items()],
        *_VIT,
        (_BLOCK + r"mlp\.scale_channel$", r"\1ls2.gamma"),
        *_stem(3),
    ],
    # one PEG (`pos_block`, after block 0) or a list of them (`pos_block.J`, J-th PEG); see _cpvt_pegs
    "cpvt": [*_VIT, (r"^pos_block\.proj\.0\.", "pegs.0.proj."), (r"^pos_block\.(\d+)\.proj\.0\.", r"pegs.\1.proj.")],
    "tnt_huawei": [
        (r"^patch_embed\.proj\.", "pixel_embed.proj."),
        (r"^outer_pos$", "pos_embed"),
        *_prefixed(
            _TNT_OPT_BLOCK,
            (
                ("inner_norm1.", "inner.norm1."),
                ("inner_attn.", "inner.mixer."),
                ("inner_norm2.", "inner.norm2."),
                ("inner_mlp.", "inner.mlp."),
                ("outer_norm1.", "outer.norm1."),
                ("outer_attn.", "outer.mixer."),
                ("outer_norm2.", "outer.norm2."),
                ("outer_mlp.", "outer.mlp."),
                ("proj_norm1.", "proj.norm1."),
                ("proj_norm2.", "proj.norm2."),
                ("proj.", "proj.fc."),
                ("se_layer.fc.0.", "outer.mlp.se.norm."),
                ("se_layer.fc.1.", "outer.mlp.se.fc1."),
                ("se_layer.fc.3.", "outer.mlp.se.fc2."),
            ),
        ),
    ],
    "tnt_timm": [
        (r"^pixel_pos$", "inner_pos"),
        (r"^patch_pos$", "pos_embed"),
        *_prefixed(
            _TNT_OPT_BLOCK,
            (
                ("norm_in.", "inner.norm1."),
                ("attn_in.", "inner.mixer."),
                ("norm_mlp_in.", "inner.norm2."),
                ("mlp_in.", "inner.mlp."),
                ("norm_out.", "outer.norm1."),
                ("attn_out.", "outer.mixer."),
                ("norm_mlp.", "outer.norm2."),
                ("mlp.", "outer.mlp."),
                ("norm1_proj.", "proj.norm1."),
                ("norm2_proj.", "proj.norm2."),
                ("proj.", "proj.fc."),
            ),
        ),
    ],
    "eamlp": [
        (r"^tokens_to_token\.attention1\.", "tokens_to_token.layers.0."),
        (r"^tokens_to_token\.attention2\.", "tokens_to_token.layers.1."),
        (_BLOCK + r"attn\.trans_dims\.", r"\1mixer.query."),
        (_BLOCK + r"attn\.linear_0\.", r"\1mixer.mk."),
        (_BLOCK + r"attn\.linear_1\.", r"\1mixer.mv."),
        (_BLOCK + r"attn\.", r"\1mixer."),
    ],
    "vitlab": [],
}

#: tensors of the reference that no computation uses: regex -> reason
DROPS: dict[str, dict[str, str]] = {
    "tnt_huawei": {r"^outer_tokens$": "frozen, unused tensor of the official TNT (docs/semantics.md, Decision T2)"},
    "tnt_timm": {r"^outer_tokens$": "frozen, unused tensor of the official TNT (docs/semantics.md, Decision T2)"},
    "eamlp": {r"^pos_embed$": "fixed sinusoid table (requires_grad=False); vitlab recomputes it for the input size"},
}


def compact_keys(keys: Iterable[str]) -> list[str]:
    """``blocks.0.x, blocks.1.x, blocks.2.x`` -> ``blocks.{0-2}.x``: numbered copies of one key, folded."""
    groups: dict[str, list[int]] = {}
    for key in keys:
        m = re.search(r"(?:^|\.)(\d+)(?=\.)", key)
        if m is None:
            groups.setdefault(key, [])
            continue
        tmpl = key[: m.start(1)] + "\0" + key[m.end(1) :]
        groups.setdefault(tmpl, []).append(int(m[1]))
    out = []
    for tmpl, idx in groups.items():
        if not idx:
            out.append(tmpl)
        elif len(idx) == 1:
            out.append(tmpl.replace("\0", str(idx[0])))
        else:
            idx = sorted(idx)
            span = f"{idx[0]}-{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) else ",".join(map(str, idx))
            out.append(tmpl.replace("\0", "{" + span + "}"))
    return out


def _fuse_qk_v(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """TNT attention: ``X.qk`` (2C, C) and ``X.v`` (C, C) -> ``X.qkv`` (3C, C), rows ``[q | k | v]`` (cat on dim 0)."""
    out: dict[str, Tensor] = {}
    fused: list[str] = []
    fused_v = set()
    for key, value in state.items():
        m = re.fullmatch(r"(.*)\.qk\.(weight|bias)", key)
        if m is None:
            continue
        v_key = f"{m[1]}.v.{m[2]}"
        if v_key not in state:
            raise ValueError(f"{key}: found no value projection {v_key} to merge into qkv")
        if value.shape[1:] != state[v_key].shape[1:]:
            raise ValueError(f"{key} {tuple(value.shape)} and {v_key} {tuple(state[v_key].shape)} cannot be fused")
        out[f"{m[1]}.qkv.{m[2]}"] = torch.cat([value, state[v_key]], dim=0)
        fused_v.add(v_key)
        fused.append(f"{m[1]}.{{qk,v}}.{m[2]}")
    for key, value in state.items():
        if key not in fused_v and re.fullmatch(r"(.*)\.qk\.(weight|bias)", key) is None:
            out[key] = value
    notes = [f"qk + v -> qkv (rows [q | k | v]): {', '.join(compact_keys(fused))}"] if fused else []
    return out, notes


def _tnt_timm(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """timm TNT: fuse ``qk``/``v``; ``pixel_pos`` (1, c, p', p') -> (1, p'·p', c), word index = row·p' + col."""
    state, notes = _fuse_qk_v(state)
    pix = state.get("pixel_pos")
    if pix is not None and pix.dim() == 4:
        state = {**state, "pixel_pos": pix.flatten(2).transpose(1, 2)}
        notes.append(f"pixel_pos {tuple(pix.shape)} -> (1, words, c) {tuple(state['pixel_pos'].shape)}")
    return state, notes


def _eamlp_token_memories(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """EAMLP token layers exist in two spellings: ``token_performer.py`` (the models' default,
    memories ``linear_0`` = M_k, ``linear_1`` = M_v) and ``token_transformer.py`` (``linear_1`` = M_k,
    ``linear_2`` = M_v). A layer with ``linear_2`` uses the second; both become ``mk`` / ``mv``."""
    out = dict(state)
    notes = []
    layers = {m[1] for k in state if (m := re.match(r"^(tokens_to_token\.attention\d+\.attn\.)", k))}
    for prefix in sorted(layers):
        second = f"{prefix}linear_2.weight" in state
        names = {"linear_1": "mk", "linear_2": "mv"} if second else {"linear_0": "mk", "linear_1": "mv"}
        for key in [k for k in state if k.startswith(prefix)]:
            head, _, leaf = key[len(prefix) :].partition(".")
            if head in names:
                out[f"{prefix}{names[head]}.{leaf}"] = out.pop(key)
        notes.append(
            f"{prefix}: memories {' / '.join(names)} -> mk / mv "
            f"({'token_transformer' if second else 'token_performer'} spelling)"
        )
    return out, notes


def _eanet_memories(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], list[str]]:
    """EANet's memories are ``Conv1d`` weights ``(out, in, 1)``; vitlab's are ``Linear`` weights ``(out, in)``."""
    out = dict(state)
    squeezed = [k for k in ("linear_0.weight", "linear_1.weight") if k in out and out[k].dim() == 3]
    for key in squeezed:
        out[key] = out[key][..., 0]
    return out, ([f"Conv1d -> Linear weights: {', '.join(squeezed)}"] if squeezed else [])


TRANSFORMS: dict[str, Transform] = {
    "eanet": _eanet_memories,
    "tnt_huawei": _fuse_qk_v,
    "tnt_timm": _tnt_timm,
    "eamlp": _eamlp_token_memories,
}


def check_source(source: str) -> str:
    if source not in KEY_RULES:
        raise ValueError(f"unknown checkpoint source {source!r}; known: {', '.join(KEY_RULES)}")
    return source


def rename_key(key: str, source: str) -> str:
    """The vitlab name of one reference key: the first matching rule of ``KEY_RULES[source]`` rewrites it."""
    for pattern, repl in KEY_RULES[check_source(source)]:
        if re.search(pattern, key):
            return re.sub(pattern, repl, key, count=1)
    return key


def convert_state(state: dict[str, Tensor], source: str) -> tuple[dict[str, Tensor], dict[str, str], list[str]]:
    """Reference state_dict -> vitlab names. Returns ``(converted, dropped {key: reason}, notes)``.

    Raises ValueError when two reference keys land on one vitlab key (a map that would silently lose a tensor).
    """
    check_source(source)
    dropped: dict[str, str] = {}
    kept: dict[str, Tensor] = {}
    for key, value in state.items():
        reason = next((r for pat, r in DROPS.get(source, {}).items() if re.search(pat, key)), None)
        if reason is None:
            kept[key] = value
        else:
            dropped[key] = reason
    notes: list[str] = []
    if source in TRANSFORMS:
        kept, notes = TRANSFORMS[source](kept)
    out: dict[str, Tensor] = {}
    origin: dict[str, str] = {}
    for key, value in kept.items():
        new = rename_key(key, source)
        if new in out:
            raise ValueError(f"checkpoint keys {origin[new]!r} and {key!r} both map to {new!r} (source {source!r})")
        out[new], origin[new] = value, key
    return out, dropped, notes


def rename_keys(state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """Reference state_dict -> vitlab names (drops unused tensors, applies value transforms)."""
    return convert_state(state, source)[0]
