"""Runs timm's own ``tests/test_models.py`` test functions, unchanged, over vitlab's models (scripts/timm_battery.sh).

Before timm's test module is imported, vitlab's models are registered in timm (``vitlab.<name>``) and timm's
``list_models`` / ``list_pretrained`` (which the test module imports to parametrise its functions) are
replaced by listings of vitlab's models: a vitlab model is listed wherever timm lists its own ViTs (each
listing's filters are matched against ``vit_<name>``), so every test timm runs on its ViT family runs on
every vitlab model, with timm's asserts. Tests that name timm's own models are deselected. The models by
design unable to satisfy one test are skipped with the reason (:data:`SKIPS`).

``VITLAB_TIMM_MODELS``: shell patterns of vitlab names to run, comma-separated (default ``*``: every
registered model).
"""

from __future__ import annotations

import fnmatch
import os

import pytest
import timm

from vitlab.interop import timm as plugin

NAMES = plugin.register()
PATTERNS = os.environ.get("VITLAB_TIMM_MODELS", "*").split(",")
#: (test function, vitlab name pattern) -> why the model cannot satisfy the test
SKIPS = {
    ("test_model_backward", "*_frozen*"): "a frozen-PEG ablation: its PEG has no gradient by design",
    ("test_model_backward_fx", "*_frozen*"): "a frozen-PEG ablation: its PEG has no gradient by design",
    ("test_model_forward_intermediates", "pcpvt_mini"): "a two-stage pyramid: timm's test asks for 3 levels",
    ("test_model_forward_intermediates_features", "pcpvt_mini"): "a two-stage pyramid: timm asks for 3 levels",
    ("test_model_forward_torchscript", "*"): "vitlab models do not script (docs/ecosystem.md): use torch.fx",
    ("test_model_forward_fx_torchscript", "*"): "vitlab models do not script (docs/ecosystem.md): use torch.fx",
}


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) and value else list(value or [])


def list_models(filter="", module="", pretrained=False, exclude_filters="", name_matches_cfg=False, include_tags=None):
    """vitlab's models where timm's filters would list its own ViTs; none with weights to download."""
    if pretrained:
        return []
    include, exclude = _as_list(filter), _as_list(exclude_filters)
    out = []
    for name in NAMES:
        short = name.split(".", 1)[1]
        alias = f"vit_{short}"
        if not any(fnmatch.fnmatch(short, p) for p in PATTERNS):
            continue
        if include and not any(fnmatch.fnmatch(alias, f) for f in include):
            continue
        if any(fnmatch.fnmatch(alias, f) for f in exclude):
            continue
        out.append(name)
    return out


def list_pretrained(filter="", exclude_filters=""):
    return []


timm.list_models, timm.list_pretrained = list_models, list_pretrained


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        name = getattr(item, "callspec", None) and item.callspec.params.get("model_name")
        if not (isinstance(name, str) and name.startswith(f"{plugin.ARCH}.")):
            dropped.append(item)  # a test of timm's own models
            continue
        short = name.split(".", 1)[1]
        for (test, pattern), reason in SKIPS.items():
            if item.originalname == test and fnmatch.fnmatch(short, pattern):
                item.add_marker(pytest.mark.skip(reason=reason))
        kept.append(item)
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)
