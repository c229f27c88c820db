"""The AFT paper's baselines as causal LMs: causality, decoding, the named Table 2/4 rows, training from the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from vitlab.tasks.lm import create_lm, lm_config
from vitlab.tasks.lm.baselines import BASELINE_ROWS
from vitlab.tasks.lm.decode import generate
from vitlab.tasks.lm.model import shift_right

TINY = [n for n in BASELINE_ROWS if n.startswith("tiny_")]
RECOMPUTED = {"tiny_reformer"}  # decodes by recomputing the prefix (no incremental form)


@pytest.mark.parametrize("name", TINY)
def test_no_future_leakage(name):
    torch.manual_seed(0)
    m = create_lm(name, max_len=20).eval()
    x = torch.randint(0, 257, (2, 20))
    out = m(x)
    for t in (0, 11):
        x2 = x.clone()
        x2[:, t + 1 :] = torch.randint(0, 256, (2, 19 - t))
        out2 = m(x2)
        if name in RECOMPUTED:  # later tokens move the LSH chunk boundaries: only the sets, not the values, change
            out2 = m(x2[:, : t + 1])
        torch.testing.assert_close(out2[:, : t + 1], out[:, : t + 1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_decoding_equals_the_forward(name):
    """Incremental states: every step's logits equal the full causal forward; LSH attention recomputes, so its
    step t equals the forward on the first t + 1 inputs."""
    torch.manual_seed(0)
    m = create_lm(name, max_len=12).eval()
    g = torch.Generator().manual_seed(1)
    seq, logits = generate(m, 9, prompt=torch.randint(0, 256, (2, 3)), generator=g, return_logits=True)
    inputs = shift_right(seq, m.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(logits, forward_logits(m, inputs, name in RECOMPUTED), rtol=1e-4, atol=1e-4)


def forward_logits(m, inputs, per_prefix: bool):
    """The forward's logits of every position: of one forward, or of position t on the first t + 1 inputs."""
    if not per_prefix:
        return m(inputs)
    return torch.stack([m(inputs[:, : t + 1])[:, t] for t in range(inputs.shape[1])], 1)


def test_table_rows_build_with_the_papers_shapes():
    with torch.device("meta"):
        performer = create_lm("performer_enwik8")
        strided = create_lm("sparse_strided_cifar")
    assert (performer.dim, len(performer.blocks), performer.max_len) == (512, 12, 1024)
    assert performer.blocks[0].mixer.num_heads == 8 and performer.blocks[0].mixer.causal
    assert (strided.dim, len(strided.blocks), strided.max_len) == (256, 128, 3072)
    assert strided.blocks[0].mixer.pattern == "strided" and strided.blocks[0].mixer.width == 96
    for name, (_, note) in BASELINE_ROWS.items():
        assert name.startswith("tiny_") or "Table" in note  # every paper row says where its figures come from
    assert lm_config("image_transformer_local_cifar", window=128)["mixer"] == ("local_attention", {"window": 128})
    with pytest.raises(ValueError, match="does not apply"):
        lm_config("performer_enwik8", window=8)
    with pytest.raises(ValueError, match="no causal form"):
        create_lm("tiny_performer", mixer="lambda")


@pytest.mark.parametrize("name", ["tiny_performer", "tiny_reformer"])
def test_train_resume_and_sample_from_the_cli(tmp_path, name):
    from vitlab.cli import main

    text = tmp_path / "t.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "run"
    args = ["lm", "train", "--model", name, "--data", str(text), "--seq-len", "24", "--batch-size", "4"]
    args += ["--eval-every", "8", "--eval-symbols", "96", "--out", str(out), "--threads", "1", "--steps", "8"]
    assert main(args) == 0
    assert main([*args[:-1], "16", "--resume"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["step"] for r in metrics["history"]] == [8, 16]
    assert metrics["final"]["train_bits"] < 8.0  # learned something beyond uniform bytes
    sample = tmp_path / "s.txt"
    assert main(["lm", "sample", str(out / "last.pt"), "--length", "8", "--num", "1", "--out", str(sample)]) == 0
    assert len(sample.read_bytes().strip()) > 0


def test_performer_redraws_are_the_same_after_resume():
    """The features depend on the saved seed and forward count only, so a run reloaded from a checkpoint
    redraws exactly what the uninterrupted run draws."""
    torch.manual_seed(0)
    m = create_lm("tiny_performer", max_len=16, mixer=("performer", {"num_features": 8, "redraw_every": 2}))
    x = torch.randint(0, 256, (1, 16))
    for _ in range(3):
        m.loss(x)
    twin = create_lm("tiny_performer", max_len=16, mixer=("performer", {"num_features": 8, "redraw_every": 2}))
    twin.load_state_dict(m.state_dict())
    m.loss(x), twin.loss(x)
    torch.testing.assert_close(twin.blocks[1].mixer.projection, m.blocks[1].mixer.projection)


def test_bench_runs_a_baseline_case():
    from vitlab.tasks.lm import bench

    step = bench.prepare_case("performer", T=64, layers=1, dim=32, batch=1)
    step.fn()
    assert step.info["mixer"][0] == "performer"
    rows = bench.ratios(
        [
            {"model": m, "T": 1024, "status": "ok", "step_s": s, "mem_mb": mem}
            for m, s, mem in (("performer", 1.0, 50.0), ("transformer", 2.0, 100.0))
        ]
    )
    assert "0.34x / 1.01x" in bench.table(rows, 1, 32, 1)  # Table 4's Performer beside the measured ratios


def test_bench_baselines_include_every_aft_row_with_its_paper_figures():
    """--baselines measures AFT-full and Table 4's AFT rows beside the baselines; the AFT rows the paper has get
    their paper ratios (against its Transformer of their shape), AFT-full (not in Table 4) an empty cell; a run
    without the T = 3072 pair names the targets it did not check."""
    import argparse

    from vitlab.tasks.lm import bench
    from vitlab.tasks.lm.targets import verdict_lines

    args = argparse.Namespace(models=["aft_local"], flash=False, baselines=True, baseline="transformer")
    models = bench.bench_models(args)
    assert {"aft_full", "aft_local_32", "aft_simple", "performer", "transformer"} <= set(models)
    measured = [("aft_full", 1.0), ("aft_local_32", 1.0), ("aft_simple", 1.0), ("transformer", 1.0)]
    rows = bench.ratios([{"model": m, "T": 1024, "status": "ok", "step_s": s, "mem_mb": 10.0} for m, s in measured])
    lines = {line.split(" | ")[0].strip("| "): line for line in bench.table(rows, 1, 32, 1).splitlines()}
    assert lines["aft_local_32"].endswith(f"| {11.2 / 28.3:.2f}x / {2.04 / 1.57:.2f}x |")
    assert lines["aft_simple"].endswith(f"| {9.6 / 28.3:.2f}x / {2.61 / 1.57:.2f}x |")
    assert lines["aft_full"].endswith("|  |")
    (line,) = verdict_lines({}, rows)
    assert "at most 0.6x the Transformer's memory and faster per training step" in line and "--tokens 3072" in line


@pytest.mark.slow
def test_reformer_lm_under_ddp_matches_one_process(tmp_path):
    """Reformer redraws its rotations every training forward: two gloo processes of 4 sequences draw the same
    rotations as each other and as one process of 8 (seeded by the saved seed and the forward count), so the
    runs end with the same weights and the same rotations."""
    from test_distributed import assert_same_run, run_all, torchrun, vitlab_cmd
    from vitlab.checkpoint import load_checkpoint

    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 8)
    args = ["lm", "train", "--model", "tiny_reformer", "--data", str(text), "--seq-len", "32", "--steps", "3"]
    args += ["--batch-size", "8", "--eval-every", "3", "--eval-symbols", "256", "--threads", "1", "--device", "cpu"]
    args += ["--dropout", "0"]
    one, two = tmp_path / "one", tmp_path / "two"
    logs = run_all(vitlab_cmd(*args, "--out", str(one)), torchrun(2, *args, "--out", str(two)))
    assert "on 2 processes (DDP)" in logs[1]
    a, b = load_checkpoint(one / "last.pt")["model"], load_checkpoint(two / "last.pt")["model"]
    assert int(a["blocks.0.mixer.forwards"]) == 3
    assert_same_run(a, b)


@pytest.mark.parametrize(
    ("name", "mixer"),
    [
        ("tiny_performer", ("performer", {"num_features": 8, "redraw_every": 1})),
        ("tiny_reformer", ("lsh_attention", {"buckets": 4, "chunk_size": 8})),
    ],
)
def test_grad_checkpointing_replays_the_draws(name, mixer):
    """A recomputed block draws what its forward pass drew (the draw advances every forward here), so gradients
    and the draw counters equal those of the run without recomputation."""
    torch.manual_seed(0)
    plain = create_lm(name, max_len=16, mixer=mixer)
    ckpt = create_lm(name, max_len=16, mixer=mixer)
    ckpt.load_state_dict(plain.state_dict())
    ckpt.set_grad_checkpointing(True)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        for m in (plain, ckpt):
            m.zero_grad()
            m.loss(x).backward()
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    assert torch.equal(plain.state_dict()["blocks.0.mixer.forwards"], ckpt.state_dict()["blocks.0.mixer.forwards"])


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_every_baseline_trains_and_samples_from_the_cli(tmp_path, name):
    from vitlab.cli import main

    text = tmp_path / "t.txt"
    text.write_bytes(b"abcdefgh" * 200)
    out = tmp_path / "run"
    args = ["lm", "train", "--model", name, "--data", str(text), "--seq-len", "16", "--batch-size", "8"]
    assert main([*args, "--steps", "30", "--eval-every", "30", "--eval-symbols", "64", "--out", str(out)]) == 0
    assert json.loads((out / "metrics.json").read_text())["final"]["train_bits"] < 6.0
    sample = tmp_path / "s.txt"
    assert main(["lm", "sample", str(out / "last.pt"), "--length", "8", "--num", "2", "--out", str(sample)]) == 0
