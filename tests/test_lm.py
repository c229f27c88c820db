"""Causal sequence models (vitlab.tasks.lm): causality, incremental decoding == full forward, bits/dim, data layout
and augmentation, overfitting, CLI, bad input. The banded causal AFT-local core is tested in test_aft.py."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DATA
from vitlab.mixers import AFTLocal
from vitlab.tasks.lm import CausalLM, bits_per_dim, create_lm, list_lms, lm_config, shift_right
from vitlab.tasks.lm.data import ByteData, ImageSequences, augment_images, images_to_sequences, sequences_to_images
from vitlab.tasks.lm.decode import IncrementalDecoder, generate

CIFAR = DATA / "cifar10" / "cifar-10-batches-py-first1017"
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
TINY = ("tiny_aft_local", "tiny_aft_simple", "tiny_aft_full", "tiny_transformer")


@pytest.fixture(autouse=True)
def one_thread():
    """Small models run faster on one thread (and much faster on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def randomise_biases(model, std=0.5):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-1] in ("u", "v", "w") and ".mixer." in name:
                p.normal_(0, std)


# ---------------------------------------------------------------- models


def test_named_configs_build_with_the_papers_shapes():
    assert {"aft_local_256_cifar", "aft_simple_cifar", "transformer_cifar", "aft_local_32_enwik8"} <= set(list_lms())
    with torch.device("meta"):
        local, simple, tfm = (create_lm(n) for n in ("aft_local_256_cifar", "aft_simple_cifar", "transformer_cifar"))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    # same linear layers; AFT-local adds the factorised bias u, v in R^{3072 x 64} per layer (d' = 64)
    assert count(simple) == count(tfm)
    assert count(local) - count(simple) == 24 * 2 * 3072 * 64
    assert tfm.blocks[0].mixer.num_heads == 2 and len(tfm.blocks) == 24 and tfm.dim == 256
    mixer = local.blocks[0].mixer
    assert type(mixer) is AFTLocal and mixer.window == 256 and mixer.causal  # the mixer itself: no LM variant
    assert lm_config("aft_local_32_enwik8")["mixer"] == ("aft_local", {"window": 32, "bias_dim": 256})


@pytest.mark.parametrize("name", TINY)
def test_no_future_leakage(name):
    torch.manual_seed(0)
    m = create_lm(name, max_len=48).eval()
    randomise_biases(m)
    x = torch.randint(0, 257, (2, 48))
    out = m(x)
    for t in (0, 11, 30):
        x2 = x.clone()
        x2[:, t + 1 :] = torch.randint(0, 256, (2, 47 - t))
        out2 = m(x2)
        assert torch.allclose(out2[:, : t + 1], out[:, : t + 1], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(out2[:, t + 1 :], out[:, t + 1 :])


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        *((n, {}) for n in TINY),
        ("tiny_aft_local", {"channels": 3}),
        ("tiny_transformer", {"tie_head": True}),
        ("tiny_aft_local", {"window": 4, "mixer": ("aft_local", {"outside": "-inf"})}),
        ("tiny_aft_full", {"bias_dim": None}),
    ],
)
def test_incremental_decoding_equals_full_forward(name, kw):
    torch.manual_seed(0)
    m = create_lm(name, max_len=40, **kw).eval()
    randomise_biases(m)
    g = torch.Generator().manual_seed(1)
    seq, logits = generate(m, 30, prompt=torch.randint(0, 256, (3, 6)), generator=g, return_logits=True)
    assert seq.shape == (3, 36) and logits.shape == (3, 36, 256)
    with torch.no_grad():
        full = m(shift_right(seq, m.vocab_size))
    assert torch.allclose(logits, full, rtol=1e-5, atol=1e-5)
    greedy = generate(m, 40, batch=2, temperature=0)
    with torch.no_grad():
        assert torch.equal(m(shift_right(greedy, 256)).argmax(-1), greedy)


@pytest.mark.parametrize("name", ["tiny_aft_local", "tiny_aft_full", "tiny_aft_simple"])
def test_incremental_decoding_stable_with_growing_large_keys(name):
    """Large keys (qkv weights x30) force rescaling of the running state; the result stays exact."""
    torch.manual_seed(0)
    m = create_lm(name, max_len=32).eval()
    randomise_biases(m, std=3.0)
    with torch.no_grad():
        for b in m.blocks:
            b.mixer.qkv.weight.mul_(30)
    seq = torch.randint(0, 256, (2, 32))
    dec = IncrementalDecoder(m, 2)
    inputs = shift_right(seq, 256)
    steps = torch.stack([dec.step(inputs[:, t]) for t in range(32)], 1)
    with torch.no_grad():
        full = m(inputs)
    assert torch.isfinite(steps).all()
    assert torch.allclose(steps, full, rtol=1e-4, atol=1e-4)


def test_sharing_options():
    shared, split = create_lm("tiny_aft_simple"), create_lm("tiny_aft_simple", channels=3)
    assert shared.embed.weight.shape == (257, 32) and split.embed.weight.shape == (3 * 256 + 1, 32)
    assert split.head.out_features == 3 * 256
    tied = create_lm("tiny_aft_simple", tie_head=True)
    assert tied.head is None
    x = torch.randint(0, 256, (1, 9))
    assert tied(x).shape == (1, 9, 256) and split(x).shape == (1, 9, 256)
    # channels=3: position t's logits come from head rows of channel t % 3
    with torch.no_grad():
        split.head.bias.zero_()
        split.head.bias[256:512] = 5.0  # the head rows of channel 1
        lg = split.logits(torch.zeros(1, 6, 32))
    assert torch.allclose(lg[0, [1, 4]], torch.full((2, 256), 5.0)) and torch.allclose(
        lg[0, [0, 2, 3, 5]], torch.zeros(4, 256)
    )


# ---------------------------------------------------------------- bits/dim


def test_bits_per_dim_on_known_distributions():
    targets = torch.randint(0, 256, (3, 17))
    assert bits_per_dim(torch.zeros(3, 17, 256), targets).item() == pytest.approx(8.0, abs=1e-6)
    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = p.log().expand(2, 4, 4)
    tg = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 3]])
    expected = -torch.log2(p[tg]).mean().item()  # (1 + 2 + 3 + 3 + 1 + 1 + 2 + 3) / 8 = 2
    assert expected == pytest.approx(2.0)
    assert bits_per_dim(logits * 1.0 + 7.0, tg).item() == pytest.approx(2.0, abs=1e-6)  # logits shift-invariant
    with pytest.raises(ValueError, match="do not match"):
        bits_per_dim(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))


def test_evaluate_reports_8_bits_for_a_uniform_model(tmp_path):
    from vitlab.tasks.lm.train import evaluate

    path = tmp_path / "t.bin"
    path.write_bytes(bytes(range(256)) * 3)
    data = ByteData(path, seq_len=32, holdout=0.25)
    m = create_lm("tiny_aft_simple", max_len=32)
    with torch.no_grad():
        m.head.weight.zero_()
        m.head.bias.zero_()
    assert evaluate(m, data, "test") == pytest.approx(8.0, abs=1e-5)  # float32 cross-entropy
    assert evaluate(m, data, "train", max_symbols=64) == pytest.approx(8.0, abs=1e-5)


# ---------------------------------------------------------------- training


def test_tiny_model_overfits_a_short_text():
    torch.manual_seed(0)
    text = SHAKESPEARE.read_bytes()[:200] if SHAKESPEARE.exists() else b"to be or not to be, that is the question " * 5
    seq = torch.tensor(list(text[:200]))[None]
    m = create_lm("tiny_aft_local", max_len=200, dim=64)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(250):
        loss = m.loss(seq)
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()
    with torch.no_grad():
        bits = bits_per_dim(m(shift_right(seq, 256)), seq).item()
    assert bits < 0.1, bits


def test_train_eval_sample_cli_on_text(tmp_path, capsys):
    from vitlab.cli import main

    text = tmp_path / "t.txt"
    text.write_bytes(SHAKESPEARE.read_bytes()[:3000] if SHAKESPEARE.exists() else bytes(range(256)) * 12)
    out = tmp_path / "run"
    args = [
        "lm",
        "train",
        "--model",
        "tiny_aft_simple",
        "--data",
        str(text),
        "--seq-len",
        "32",
        "--steps",
        "30",
        "--batch-size",
        "4",
        "--eval-every",
        "15",
        "--eval-symbols",
        "256",
        "--out",
        str(out),
        "--threads",
        "1",
        "--valid",
        "300",
    ]
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["step"] for r in metrics["history"]] == [15, 30]
    assert metrics["final"]["test_bits"] < 8.0 and metrics["final"]["train_bits"] < 8.0
    assert metrics["final"]["valid_bits"] < 8.0  # the validation part before the held-out tail
    assert main(["lm", "eval", str(out / "last.pt"), "--split", "valid", "--eval-symbols", "256"]) == 0
    assert "valid: " in capsys.readouterr().out
    assert main(["lm", "eval", str(out / "last.pt"), "--data", str(text), "--json", str(tmp_path / "e.json")]) == 0
    ev = json.loads((tmp_path / "e.json").read_text())
    assert ev["test_bits"] == pytest.approx(metrics["final"]["test_bits"], rel=1e-5)
    assert (
        main(
            [
                "lm",
                "sample",
                str(out / "last.pt"),
                "--length",
                "20",
                "--num",
                "2",
                "--prompt",
                "ROMEO",
                "--out",
                str(tmp_path / "s.txt"),
            ]
        )
        == 0
    )
    samples = (tmp_path / "s.txt").read_bytes()
    assert samples.startswith(b"ROMEO") and samples.count(b"ROMEO") == 2
    # resuming a finished run continues from its last step
    assert main([*args, "--resume", "--steps", "40"]) == 0
    assert json.loads((out / "metrics.json").read_text())["history"][-1]["step"] == 40
    capsys.readouterr()
    assert main(["lm", "list"]) == 0
    assert "aft_local_256_cifar" in capsys.readouterr().out
    assert main(["lm", "eval", str(tmp_path / "missing.pt")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.skipif(not CIFAR.exists(), reason="CIFAR-10 sample batches not found")
def test_train_and_sample_images_on_cifar(tmp_path):
    from PIL import Image

    from vitlab.cli import main

    out = tmp_path / "img"
    assert (
        main(
            [
                "lm",
                "train",
                "--model",
                "tiny_aft_local",
                "--data",
                str(CIFAR),
                "--img-size",
                "4",
                "--steps",
                "4",
                "--batch-size",
                "2",
                "--eval-symbols",
                "96",
                "--out",
                str(out),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    m = json.loads((out / "metrics.json").read_text())
    assert m["kind"] == "images" and m["seq_len"] == 48 and m["final"]["test_bits"] > 0
    png = tmp_path / "grid.png"
    assert (
        main(
            [
                "lm",
                "sample",
                str(out / "last.pt"),
                "--num",
                "3",
                "--out",
                str(png),
                "--prompt-rows",
                "2",
                "--data",
                str(CIFAR),
            ]
        )
        == 0
    )
    img = Image.open(png)
    assert img.size[0] > 4 and img.mode == "RGB"


# ---------------------------------------------------------------- data


def test_image_sequences_are_raster_rgb_interleaved():
    imgs = torch.arange(2 * 3 * 2 * 2, dtype=torch.uint8).view(2, 3, 2, 2)
    seq = images_to_sequences(imgs)
    # image 0: pixel (0,0) -> R=0, G=4, B=8; pixel (0,1) -> 1, 5, 9; ...
    assert seq[0, :6].tolist() == [0, 4, 8, 1, 5, 9]
    assert torch.equal(sequences_to_images(seq, (2, 2)), imgs)
    with pytest.raises(ValueError, match="expected sequences"):
        sequences_to_images(seq[:, :5], (2, 2))


def test_augmentation_flips_and_shifts_each_image_by_one_value():
    torch.manual_seed(0)
    imgs = torch.randint(20, 236, (64, 3, 4, 4), dtype=torch.uint8)
    aug = augment_images(imgs, torch.Generator().manual_seed(0)).short()
    flips, shifts = 0, set()
    for a, x in zip(aug, imgs.short()):
        for cand, flipped in ((x, False), (x.flip(-1), True)):
            d = a - cand
            if (d == d.flatten()[0]).all():
                shifts.add(int(d.flatten()[0]))
                flips += flipped
                break
        else:
            raise AssertionError("augmented image is not a flipped/shifted copy")
    assert 10 < flips < 54 and shifts <= set(range(-10, 11)) and len(shifts) > 5
    dark = augment_images(torch.zeros(50, 3, 2, 2, dtype=torch.uint8), torch.Generator().manual_seed(1))
    assert dark.min() == 0 and dark.max() <= 10  # clipped at 0


def test_byte_data_split_and_windows(tmp_path):
    path = tmp_path / "b.bin"
    path.write_bytes(bytes(range(200)) * 5)  # 1000 bytes
    data = ByteData(path, seq_len=30, holdout=0.1)
    assert len(data.part("train")) == 900 and data.part("test")[0].item() == 900 % 200
    batches = list(data.eval_batches("test", 2))
    assert sum(b.shape[0] for b in batches) == 3 and torch.equal(torch.cat(batches).flatten(), data.part("test")[:90])
    s = data.sample(5, torch.Generator().manual_seed(0))
    assert s.shape == (5, 30) and ((s[:, 1:].long() - s[:, :-1].long()) % 200 == 1).all()  # contiguous windows
    with pytest.raises(ValueError, match="seq-len"):
        ByteData(path, seq_len=200, holdout=0.1)
    with pytest.raises(ValueError, match=r"holdout must be a fraction in \(0, 1\) or a byte count .* got -5"):
        ByteData(path, seq_len=30, holdout=-5)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt is empty: byte data needs a file"):
        ByteData(tmp_path / "empty.txt", seq_len=30)


def test_byte_data_validation_part_sits_before_the_test_tail(tmp_path):
    """enwik8's split: train, then a validation part, then the test tail (here 800 / 100 / 100 bytes)."""
    path = tmp_path / "b.bin"
    data_bytes = bytes(range(250)) * 4  # 1000 bytes
    path.write_bytes(data_bytes)
    data = ByteData(path, seq_len=30, holdout=100, valid=0.1)
    assert list(data.parts) == ["train", "valid", "test"]
    whole = torch.cat([data.part("train"), data.part("valid"), data.part("test")])
    assert torch.equal(whole, torch.tensor(list(data_bytes), dtype=torch.uint8))
    assert (len(data.part("train")), len(data.part("valid")), len(data.part("test"))) == (800, 100, 100)
    assert list(ByteData(path, seq_len=30, holdout=100).parts) == ["train", "test"]  # no validation part
    with pytest.raises(ValueError, match=r"valid must be 0 or hold at least seq_len=30"):
        ByteData(path, seq_len=30, holdout=100, valid=10)
    with pytest.raises(ValueError, match=r"split must be one of 'train', 'test', got 'valid'"):
        ByteData(path, seq_len=30, holdout=100).part("valid")
    with pytest.raises(ValueError, match="seq-len"):
        ByteData(path, seq_len=30, holdout=500, valid=480)


@pytest.mark.skipif(not CIFAR.exists(), reason="CIFAR-10 sample batches not found")
def test_cifar_sequences_from_the_real_batches():
    data = ImageSequences.cifar10(CIFAR)
    assert data.seq_len == 3072 and len(data.part("train")) == 2 * 1017 and len(data.part("test")) == 1017
    first = next(data.eval_batches("test", 4))
    assert first.shape == (4, 3072) and first.dtype == torch.uint8
    small = ImageSequences.cifar10(CIFAR, img_size=8)
    assert small.seq_len == 192
    x = data.part("test")[:1].float()
    assert torch.allclose(small.part("test")[:1].float(), torch.nn.functional.avg_pool2d(x, 4).round())


# ---------------------------------------------------------------- bad input


def test_bad_input():
    m = create_lm("tiny_aft_simple", max_len=16)
    with pytest.raises(ValueError, match="max_len"):
        m(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids"):
        m(torch.full((1, 4), 300))
    with pytest.raises(ValueError, match="integer tokens"):
        m(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="did you mean"):
        create_lm("aft_local_cifar")
    with pytest.raises(ValueError, match="unknown option"):
        create_lm("tiny_aft_local", mixer=("aft_local", {"windw": 3}))
    with pytest.raises(ValueError, match="every CausalLM mixer is causal"):
        create_lm("tiny_aft_local", mixer=("aft_local", {"window": 3, "causal": False}))
    with pytest.raises(ValueError, match="does not apply"):
        create_lm("tiny_aft_simple", window=4)
    with pytest.raises(ValueError, match="unknown causal mixer"):
        CausalLM(mixer="refiner")
    with pytest.raises(ValueError, match="eval mode"):
        IncrementalDecoder(m.train(), 1)
    with pytest.raises(ValueError, match="max_len"):
        generate(m.eval(), 20)


def test_dropout_acts_in_training_only():
    m = create_lm("tiny_aft_local", max_len=16, dropout=0.5)
    x = torch.randint(0, 256, (2, 16))
    assert not torch.allclose(m.train()(x), m(x))
    m.eval()
    assert torch.equal(m(x), m(x))
    # residual dropout sits on the mixer branch of every block (and inside the MLP)
    assert all(b.drop_mix.p == 0.5 and b.mlp.drop1.p == 0.5 for b in m.blocks)


def test_recomputed_core_gives_the_same_outputs_and_gradients():
    torch.manual_seed(0)
    plain = create_lm("tiny_aft_local", max_len=40)
    randomise_biases(plain)
    rc = create_lm("tiny_aft_local", max_len=40, mixer=("aft_local", {"window": 8, "bias_dim": 16, "recompute": True}))
    rc.load_state_dict(plain.state_dict())
    assert rc.blocks[0].mixer.recompute and not plain.blocks[0].mixer.recompute
    x = torch.randint(0, 256, (2, 40))
    grads = []
    for m in (plain, rc):
        loss = m.loss(x)
        loss.backward()
        grads.append([p.grad for p in m.parameters()])
    assert torch.allclose(plain.loss(x), rc.loss(x))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads))


def test_bench_case_and_ratios():
    from vitlab.tasks.lm import bench
    from vitlab.tasks.lm import targets as lm_targets

    step = bench.prepare_case("aft_local_rc", T=64, layers=1, dim=32, batch=1)
    step.fn()
    assert step.info["mixer"][1]["recompute"] and step.info["rss_before_model"] > 0
    results = [
        {"model": m, "T": 3072, "status": "ok", "step_s": s, "mem_mb": mem}
        for m, s, mem in (("aft_local", 1.0, 50.0), ("transformer", 2.0, 100.0), ("transformer_flash", 4.0, 200.0))
    ]
    rows = bench.ratios(results)
    merged = bench.summarise(
        [
            {"model": "aft_local", "T": 8, "status": "ok", "mem_mb": m, "time_s": {"times": ts}}
            for m, ts in ((10.0, [3.0, 2.0]), (12.0, [2.5, 4.0]))
        ]
    )
    assert merged == [
        {
            "model": "aft_local",
            "T": 8,
            "dtype": "fp32",
            "status": "ok",
            "step_s": 2.0,
            "median_s": 2.75,
            "mem_mb": 12.0,
            "steps_timed": 4,
        }
    ]
    assert [(r["model"], r["mem_ratio"], r["speed_ratio"]) for r in rows][:2] == [
        ("aft_local", 0.5, 2.0),
        ("transformer", 1.0, 1.0),
    ]
    v = lm_targets.judge(rows)["aft_local"]
    assert v["mem_met"] and v["speed_met"]
    text = "\n".join(lm_targets.verdict_lines(lm_targets.judge(rows), rows))
    assert "0.25x" in text and "4.00x" in text  # against the flash Transformer (no attention dropout)


def test_transformer_baseline_drops_attention_weights():
    """``attn_dropout`` (default: ``dropout``) reaches the attention mixer; AFT mixers have no such weights."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 16))
    drops = create_lm("tiny_transformer", dropout=0.0, attn_dropout=0.5).train()
    assert drops.blocks[0].mixer.attn_drop.p == 0.5
    assert not torch.equal(drops.loss(x), drops.loss(x))  # only the attention weights are dropped
    assert torch.equal(drops.eval().loss(x), drops.loss(x))
    plain = create_lm("tiny_transformer", dropout=0.0, attn_dropout=0.0).train()
    assert torch.equal(plain.loss(x), plain.loss(x))
    assert create_lm("tiny_transformer", dropout=0.1).blocks[0].mixer.attn_drop.p == 0.1  # follows dropout
    assert create_lm("tiny_aft_simple", dropout=0.1).config["attn_dropout"] == 0.1
    with pytest.raises(ValueError, match="attn_dropout"):
        create_lm("tiny_transformer", attn_dropout=1.0)


def test_bias_dim_full_from_the_command_line(tmp_path):
    """AFT Table 3's non-factorised bias: ``--bias-dim full`` (or ``none``) gives a full T x T table."""
    import argparse

    from vitlab.cli import main
    from vitlab.cli.lm import FULL_BIAS, bias_dim

    assert bias_dim("full") == bias_dim("None") == FULL_BIAS and bias_dim("64") == 64
    for bad in ("0", "-3", "wide"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer or 'full'"):
            bias_dim(bad)
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4)
    out = tmp_path / "run"
    argv = ["lm", "train", "--model", "tiny_aft_local", "--data", str(text), "--seq-len", "16", "--steps", "2"]
    argv += ["--batch-size", "2", "--eval-every", "2", "--eval-symbols", "64", "--out", str(out), "--threads", "1"]
    assert main([*argv, "--bias-dim", "full"]) == 0
    state = torch.load(out / "last.pt", weights_only=True)["model"]
    assert state["blocks.0.mixer.w"].shape == (16, 16) and "blocks.0.mixer.u" not in state
