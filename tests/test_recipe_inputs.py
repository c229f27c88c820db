"""Recipe files as users and attackers write them: each mistake is one line before any work."""

from __future__ import annotations

import argparse
from pathlib import Path

from vitlab.cli import main as cli_main
from vitlab.engine.recipes import MAX_ALIASES, apply_recipe, load_recipe, shipped_recipes


def _refused(capsys, recipe: Path, *extra: str) -> str:
    capsys.readouterr()
    assert cli_main(["train", "--config", str(recipe), "--epochs", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_key_given_twice_is_refused_in_yaml_and_toml(tmp_path, capsys):
    yaml_file = tmp_path / "dup.yaml"
    yaml_file.write_text("model: deit_mini\nmodel_args: {depth: 1, depth: 2}\n")
    assert "key 'depth' is given twice" in _refused(capsys, yaml_file)
    yaml_file.write_text("model: deit_mini\nlr: 0.1\nlr: 0.2\n")
    assert "key 'lr' is given twice (again on line 3)" in _refused(capsys, yaml_file)
    toml_file = tmp_path / "dup.toml"
    toml_file.write_text("lr = 0.1\nlr = 0.2\n")
    assert "not valid TOML" in _refused(capsys, toml_file)


def test_an_alias_expansion_bomb_is_refused_at_once(tmp_path, capsys):
    """Nine levels of nine aliases each (9^9 values if expanded): refused while reading, by the alias count."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("model_args:\n" + "".join(f"  {line}\n" for line in lines))
    assert f"more than {MAX_ALIASES} aliases" in _refused(capsys, bomb)
    few = tmp_path / "few.yaml"
    few.write_text("mixup: &m 0.8\ncutmix: *m\n")  # a few aliases are fine
    assert load_recipe(str(few))[1] == {"mixup": 0.8, "cutmix": 0.8}


def test_wrong_types_folders_and_binary_files_are_one_line(tmp_path, capsys):
    bad = tmp_path / "int.yaml"
    bad.write_text("data: 3\n")
    assert "data must be a string, got 3" in _refused(capsys, bad)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00model: x")
    assert "not UTF-8" in _refused(capsys, binary)
    (tmp_path / "folder.yaml").mkdir()
    assert "is a folder" in _refused(capsys, tmp_path / "folder.yaml")


def test_a_distillation_recipe_needs_a_teacher(tmp_path, capsys):
    """deit_tiny_distilled without --teacher would train without distillation: refused, naming the option; every
    shipped recipe still loads."""
    err = _refused(capsys, shipped_recipes()["deit_tiny_distilled"])
    assert "distils from a teacher" in err and "--teacher" in err
    args = argparse.Namespace(config="deit_tiny_distilled", model_args=[], teacher="teacher.pt2", given={"teacher"})
    apply_recipe(args)
    assert args.distillation == "hard"
    for name in shipped_recipes():
        load_recipe(name)


def test_a_fine_tuning_recipe_needs_its_data_and_starting_checkpoint(tmp_path, capsys):
    """Without --data and --init-from a fine-tuning recipe would train from scratch on the default data: refused,
    naming what to pass; every shipped recipe that fine-tunes says what it needs."""
    err = _refused(capsys, Path("tnt_small_384_pets"), "--out", str(tmp_path / "run"))
    assert "needs --data: Oxford-IIIT Pets" in err
    err = _refused(capsys, Path("tnt_small_384_pets"), "--data", f"pets:{tmp_path}", "--out", str(tmp_path / "r"))
    assert "needs --init-from: a TNT-S checkpoint" in err
    for name in shipped_recipes():
        needs = load_recipe(name)[2]["needs"]
        from_224 = name.startswith("refiner_vit_") and name.endswith(("_384", "_448"))
        if from_224 or name.endswith("_ft") or name.startswith("tnt_small_384_"):
            assert "init_from" in needs, name
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: deit_mini\nneeds: {not_an_option: x}\n")
    assert "needs must map options of vitlab train" in _refused(capsys, bad)


def test_every_value_has_its_options_type_and_lr_is_not_beside_base_lr(tmp_path, capsys):
    """A value is checked against the type of its option (the annotation of TrainConfig's field) before its
    range, so no check meets a value it cannot read (auto_augment: 7 was a traceback); lr beside base_lr would
    drop lr silently."""
    cases = {
        "auto_augment: 7\n": "auto_augment must be a string (or null), got 7",
        "auto_augment = 7\n": "auto_augment must be a string (or null), got 7",  # TOML
        "epochs: true\n": "epochs must be an integer, got True",
        "epochs: 2.5\n": "epochs must be an integer, got 2.5",
        "epochs: null\n": "epochs must be an integer, got null",
        "lr: 1e-3\n": "lr must be a number, got '1e-3' (a number as text: drop the quotes; YAML also reads 1e-3 as "
        "text, write 1.0e-3)",
        "mixup: [0.8]\n": "mixup must be a number, got [0.8]",
        "dist_token: 1\n": "dist_token must be true or false, got 1",
        "model_args: [1, 2]\n": "model_args must be a mapping of constructor options, got [1, 2]",
        "img_size: {a: 1}\n": "img_size must be an integer (or null), got {'a': 1}",
        "lr: 0.001\nbase_lr: 0.0005\n": "lr and base_lr both set the learning rate",
    }
    for i, (text, words) in enumerate(cases.items()):
        recipe = tmp_path / (f"r{i}.toml" if " = " in text else f"r{i}.yaml")
        recipe.write_text(text)
        assert words in _refused(capsys, recipe, "--out", str(tmp_path / "run")), text
    good = tmp_path / "good.yaml"
    good.write_text("lr: 1.0e-3\nimg_size: null\nepochs: 3\nmixup: 1\nauto_augment: rand-m9-n2\n")
    assert load_recipe(str(good))[1]["mixup"] == 1
