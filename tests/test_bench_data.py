"""``vitlab bench-data``'s verdict: which side limits training, the loader or the step."""

from __future__ import annotations

from vitlab.bench.data import bottleneck


def test_bottleneck_names_the_slower_side_with_the_most_workers():
    rows = [
        {"pipeline": "vitlab+recipe", "workers": 1, "img_s": 100.0},
        {"pipeline": "vitlab+recipe", "workers": 16, "img_s": 1500.0},
        {"pipeline": "vitlab", "workers": 16, "img_s": 9000.0},  # without the recipe: not what training runs
    ]
    steps = [
        {"model": "deit_small_patch16_224", "dtype": "fp32", "img_s": 1000.0},
        {"model": "deit_small_patch16_224", "dtype": "bf16", "img_s": 6000.0},
    ]
    doc = {"options": {"workers": [1, 16]}, "throughput": rows, "steps": steps}
    fp32, bf16 = bottleneck(doc)
    assert (
        "fp32, vitlab+recipe: the step (the loader keeps up): loader 1500 img/s with 16 workers, step 1000 img/s"
        in fp32
    )
    assert "bf16, vitlab+recipe: the loader, short by 75 %" in bf16
    assert bottleneck({**doc, "steps": []}) == []
