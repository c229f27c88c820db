"""Other code's weights and formats: checkpoints of the official code and timm loaded into vitlab models
(:mod:`.keymaps`, :mod:`.convert`, :mod:`.rebuild`), safetensors weights, weight transfer (:mod:`.transfer`), models
with weights in one call (:mod:`.pretrained`), export (:mod:`.export`) and the timm and Hugging Face adapters
(:mod:`.timm`, :mod:`.hf`). The package re-exports the conversion API:

>>> model = vitlab.create_model("tnt_s_patch16_224")
>>> report = load_reference(model, "tnt_s_81.5.pth.tar", source="tnt_huawei")  # strict: raises on misfit
>>> save_weights(model, "tnt_s.safetensors")
"""

from .convert import (
    LoadReport,
    detect_source,
    load_reference,
    load_weights,
    read_checkpoint,
    save_weights,
    unwrap_state,
)
from .keymaps import DROPS, KEY_RULES, SOURCES, TRANSFORMS, convert_state, rename_key, rename_keys
from .transfer import DEIT_TO_AFT_EXCLUDE, init_from, transfer_deit_to_aftconv

__all__ = [
    "DEIT_TO_AFT_EXCLUDE",
    "DROPS",
    "KEY_RULES",
    "SOURCES",
    "TRANSFORMS",
    "LoadReport",
    "convert_state",
    "detect_source",
    "init_from",
    "load_reference",
    "load_weights",
    "read_checkpoint",
    "rename_key",
    "rename_keys",
    "save_weights",
    "transfer_deit_to_aftconv",
    "unwrap_state",
]
