"""The import paths of the release before the folders moved still import, for one release: each as a stand-in
that hands out the new modules' objects, with one DeprecationWarning (vitlab.common.deprecated)."""

from __future__ import annotations

import json
import subprocess
import sys

from vitlab.common.deprecated import OLD_PATHS

# an old spelling of a name -> the object it must be now
SAME_OBJECT = {
    "vitlab.train:TrainConfig": "vitlab.engine.config:TrainConfig",
    "vitlab.train:train": "vitlab.engine.loop:train",
    "vitlab.train.compare:run_variants": "vitlab.experiments.runner:run_variants",
    "vitlab.train.compare:add_arguments": "vitlab.cli.compare:add_arguments",
    "vitlab.train.distill:DistillationLoss": "vitlab.distill.loss:DistillationLoss",
    "vitlab.seg:build_segmenter": "vitlab.tasks.segmentation.models:build_segmenter",
    "vitlab.points:PointSet": "vitlab.tasks.points.data:PointSet",
    "vitlab.lm:CausalLM": "vitlab.tasks.lm.model:CausalLM",
    "vitlab.convert:load_reference": "vitlab.interop.convert:load_reference",
    "vitlab.integrations.timm:register": "vitlab.interop.timm:register",
    "vitlab.pretrained:load_model": "vitlab.interop.pretrained:load_model",
}

PROBE = r"""
import importlib, json, sys, warnings
warnings.simplefilter("always")
old_paths, same = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def get(spec):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for old in old_paths:
        importlib.import_module(old)
        importlib.import_module(old)  # a second import: no second warning
    import vitlab
    attribute_ok = vitlab.train is sys.modules["vitlab.train"]
    from vitlab import pretrained  # the form `from package import module`
    same_ok = {old: get(old) is get(new) for old, new in same.items()}
warned = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)
          and str(w.message).startswith("vitlab.")]
print(json.dumps({"warned": warned, "attribute_ok": attribute_ok, "same_ok": same_ok,
                  "has_load_model": hasattr(pretrained, "load_model")}))
"""


def test_every_old_path_imports_warns_once_and_hands_out_the_new_objects():
    old = [f"vitlab.{p}" for p in OLD_PATHS]
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(old), json.dumps(SAME_OBJECT)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    got = json.loads(out.stdout)
    warned = [w.split(" ", 1)[0] for w in got["warned"]]
    assert sorted(warned) == sorted(old), "each old path warns exactly once"
    assert all("import vitlab." in w for w in got["warned"])  # the warning names the new path
    assert got["attribute_ok"] and got["has_load_model"]
    assert all(got["same_ok"].values()), got["same_ok"]


def test_every_new_target_exists_and_old_paths_are_not_modules_of_the_package():
    import importlib
    from pathlib import Path

    import vitlab

    pkg = Path(vitlab.__file__).parent
    for old, targets in OLD_PATHS.items():
        assert not (pkg / (old.replace(".", "/") + ".py")).exists(), old
        for target in targets:
            importlib.import_module(f"vitlab.{target}")
