"""vitlab bench: MAC counts against the targets of docs/models.md, the TNT paper's per-block complexity formulas, the
analytic FLOPs of the mixers, the GEMM yardstick, a tiny CLI run, and the inference fast paths added for speed (each
must compute the same function as the reference path it replaces).

The parameter formula Params_TNT = 12cc + mcd + 12dd is checked term by term in tests/test_tnt.py
(test_block_params_formula); FLOPs_TNT for TNT-S dims is in tests/test_tnt.py too. Here: FLOPs_T on the generic
ViT block, FLOPs_TNT on TNT-Ti/S/B dims, both through the benchmark's own counter (meta and real CPU tensors).
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from torch.utils.flop_counter import sdpa_backward_flop_count

import vitlab
from vitlab.bench import models as bench
from vitlab.cli import bench as bench_cli
from vitlab.layers import Block
from vitlab.layers.patch_embed import PatchEmbed
from vitlab.measure.flops import count_flops, count_macs, flop_counter, mixer_extra_flops
from vitlab.measure.gemm import measure_gemm
from vitlab.mixers import (
    MIXERS,
    AFTFull,
    AFTLocal,
    AFTSimple,
    Attention,
    DistributedLocalAttention,
    ExternalAttention,
    MultiHeadExternalAttention,
    ReAttention,
    RefinerAttention,
)
from vitlab.mixers.base import RELU6, SIGMOID, SOFTMAX
from vitlab.models.tnt import TNTBlock

# MAC targets at 224 from the official configurations (docs/models.md; the papers' "FLOPs" are MACs)
SPEC_GMACS = {
    "deit_tiny_patch16_224": 1.25,
    "deit_small_patch16_224": 4.60,
    "deit_base_patch16_224": 17.56,
    "tnt_ti_patch16_224": 1.40,
    "tnt_s_patch16_224": 5.22,
    "tnt_b_patch16_224": 14.05,
}


# -------------------------------------------------------------------------- MACs against the targets


@pytest.mark.parametrize("name, spec", SPEC_GMACS.items())
def test_macs_within_2_percent_of_spec(name, spec):
    with torch.device("meta"):
        model = vitlab.create_model(name)
    macs = count_macs(model, (3, 224, 224)).gmacs
    assert macs == pytest.approx(spec, rel=0.02)
    counts = count_flops(model, (3, 224, 224), batch=2)  # the benchmark's path: linear in the batch
    assert counts.macs / 2e9 == pytest.approx(macs, rel=1e-9)
    assert counts.flops > 2 * counts.macs  # the attention softmax on top


def test_cpu_sdpa_is_counted_like_meta():
    """torch's flop counter does not know SDPA's CPU kernel; the benchmark's counter does."""
    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini").eval()
    on_cpu = count_flops(model, (3, 32, 32), device="cpu")
    on_meta = count_flops(model, (3, 32, 32))
    assert on_cpu.macs == on_meta.macs and on_cpu.extra_flops == on_meta.extra_flops
    q = torch.randn(2, 3, 10, 8, requires_grad=True)
    with flop_counter() as fc:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        fwd = fc.get_total_flops()
        out.sum().backward()
    assert fwd == 2 * (2 * 3 * 10 * 10 * 8) * 2  # QKᵀ and AV, 2 FLOPs per MAC
    shape = (2, 3, 10, 8)  # the flash backward: torch's own formula (five products)
    assert fc.get_total_flops() - fwd == sdpa_backward_flop_count(shape, shape, shape, shape) == 2.5 * fwd


# ----------------------------------------------------------------------------- TNT paper Sec. 2.3 formulas


def flops_t(n: int, d: int) -> int:
    return 2 * n * d * (6 * d + n)


def flops_tnt(n: int, d: int, m: int, c: int) -> int:
    return 2 * n * m * c * (6 * c + m) + n * m * c * d + flops_t(n, d)


def block_macs(module: torch.nn.Module, *inputs: torch.Tensor) -> int:
    with flop_counter() as fc, torch.no_grad():
        module(*inputs)
    return fc.get_total_flops() // 2


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("n, d, heads", [(196, 384, 6), (50, 64, 2), (17, 48, 3)])
def test_flops_t_is_a_vit_block(device, n, d, heads):
    """FLOPs_T = 2nd(6d + n): the MACs of one pre-norm block (qkv 3nd², proj nd², MLP 8nd², QKᵀ and AV n²d each),
    through SDPA (on CPU its flash kernel, counted by the benchmark) and through the explicit map."""
    if device == "cpu" and n * d > 20000:
        pytest.skip("real tensors only for the small shapes")
    with torch.device(device):
        for fused in (True, False):
            blk = Block(d, Attention(d, heads, fused=fused)).eval()
            assert block_macs(blk, torch.zeros(1, n, d), None) == flops_t(n, d)


@pytest.mark.parametrize("d, c, heads, inner_heads", [(192, 12, 3, 2), (384, 24, 6, 4), (640, 40, 10, 4)])
def test_flops_tnt_on_tnt_ti_s_b_dims(d, c, heads, inner_heads):
    """FLOPs_TNT = 2nmc(6c + m) + nmcd + 2nd(6d + n) for one TNT block (n = 196 sentences of m = 16 words);
    the outer transformer also sees the class token: its term is FLOPs_T(n + 1), the rest is exactly the paper's."""
    n, m = 196, 16
    with torch.device("meta"):
        blk = TNTBlock(d, c, heads, inner_heads, num_words=m).eval()
        got = block_macs(blk, torch.empty(n, m, c), torch.empty(1, n + 1, d))
    assert got == flops_tnt(n, d, m, c) - flops_t(n, d) + flops_t(n + 1, d)
    assert got == pytest.approx(flops_tnt(n, d, m, c), rel=0.01)
    if d == 384:  # paper: 376M and 429M per block for TNT-S
        assert round(flops_t(n, d) / 1e6) == 376 and round(flops_tnt(n, d, m, c) / 1e6) == 429


def test_tnt_model_macs_are_embedding_plus_twelve_blocks_plus_head():
    d, c, n, m, classes = 384, 24, 196, 16, 1000
    with torch.device("meta"):
        model = vitlab.create_model("tnt_s_patch16_224")
    embed = n * m * c * 3 * 49 + n * (m * c) * d  # 7x7 word conv (4x4 outputs per patch), words -> sentence
    blocks = 12 * (flops_tnt(n, d, m, c) - flops_t(n, d) + flops_t(n + 1, d))
    assert count_macs(model, (3, 224, 224)).total == embed + blocks + d * classes


# ----------------------------------------------------------------------------- analytic extras of the mixers


def test_extras_attention_and_reattention_by_hand():
    b, n, heads = 2, 7, 3
    x = torch.empty(b, n, 24)
    maps = b * heads * n * n
    softmax = maps * (1 + 5)  # scale, then max / subtract / exp / sum / divide
    assert mixer_extra_flops(Attention(24, heads), x) == {"attention softmax": softmax}
    eval_bn, train_bn = 2, 5
    re = ReAttention(24, heads, transform_scale=True).eval()
    assert mixer_extra_flops(re, x) == {"re-attention maps": softmax + maps * (1 + eval_bn + 1)}  # bias, BN, scale
    re_train = ReAttention(24, heads).train()  # no scale, BN with batch statistics
    assert mixer_extra_flops(re_train, x) == {"re-attention maps": softmax + maps * (1 + train_bn)}


def test_extras_refiner_by_hand():
    b, n, heads, r = 2, 5, 2, 3
    x, prev = torch.empty(b, n, 16), torch.empty(b, heads, n, n)
    maps = b * n * n  # one map plane
    shared = RefinerAttention(16, heads, expansion=r, official_extras=True, share=True).eval()
    # expand: BN 2 + ReLU6 2 on rH maps; dw conv: BN 2 + ReLU6 2 on rH; reduce: BN 2 on H; + input map on H;
    # adapt_bn 2 on H; the scale 1 on H (the convolutions themselves are MACs)
    want = (2 + 2) * r * heads * maps * 2 + 2 * heads * maps + heads * maps + 2 * heads * maps + heads * maps
    assert mixer_extra_flops(shared, x, attn_prev=prev) == {"refiner maps": want}
    normal = RefinerAttention(16, heads, refine=False, residual_attention=True).eval()
    softmax = (1 + 5) * heads * maps
    assert mixer_extra_flops(normal, x, attn_prev=prev) == {"refiner maps": softmax + 2 * heads * maps}
    assert mixer_extra_flops(normal, x) == {"refiner maps": softmax}  # first block: no previous map
    paper = RefinerAttention(16, heads, expansion=r)  # the paper's linear refiner: only the softmax is extra
    assert mixer_extra_flops(paper, x) == {"refiner maps": softmax}


def test_refiner_dla_convolution_is_counted_as_macs():
    """The depth-wise k x k convolution over the N x N maps: rH · N² · k² MACs (plus the two head mixes)."""
    b, heads, r, n, k = 2, 2, 3, 9, 3
    dla = DistributedLocalAttention(heads, r, k).eval()
    got = block_macs(dla.to("meta"), torch.empty(b, heads, n, n, device="meta"))
    assert got == b * n * n * (heads * r * heads + r * heads * k * k + r * heads * heads)


def test_extras_external_attention_by_hand():
    b, n = 2, 6
    x = torch.empty(b, n, 16)
    # per (token, slot): softmax over tokens 5, ℓ1 sum 1, divide 1; + eps once per token row
    single = ExternalAttention(16, memory_size=8)
    assert mixer_extra_flops(single, x) == {"external attention norm": b * (7 * n * 8 + n)}
    multi = MultiHeadExternalAttention(16, num_heads=2, coef=4)  # 8 heads of the widened query, S = 64
    assert mixer_extra_flops(multi, x) == {"external attention norm": b * 8 * (7 * n * 64 + n)}


def test_extras_aft_by_hand():
    b, t, c = 2, 5, 4
    x = torch.empty(b, t, c)
    simple = b * t * c * (SOFTMAX + 1 + 1 + SIGMOID + 1)  # softmax_t'(K), ⊙V, Σ_t', sigmoid(Q), gate
    assert mixer_extra_flops(AFTSimple(c), x) == {"AFT": simple}
    full = b * t * c * (3 + 1 + 1 + SIGMOID + 1) + 3 * t * t  # e^{K-max}, ⊙V, divide, sigmoid, gate; e^{w-max}
    assert mixer_extra_flops(AFTFull(c, max_len=t), x) == {"AFT": full}
    assert mixer_extra_flops(AFTLocal(c, max_len=8, window=2, resample=True), x) == {"AFT": full}  # resampled w
    assert mixer_extra_flops(AFTLocal(c, max_len=t, window=5), x) == {"AFT": full}  # T <= window
    long = torch.empty(b, 40, c)  # causal, window < T <= max_len: the O(T·s·d) band, blocks of 16 (MIN_BLOCK)
    band = b * 40 * c * (3 + 1 + 6 + 1 + SIGMOID + 1) + 3 * 3 * 16 * 32  # 3 blocks of 16 x 32 band entries
    assert mixer_extra_flops(AFTLocal(c, max_len=40, window=2, causal=True), long) == {"AFT": band}
    # not causal, window < T == max_len: 3 blocks of 16 x 48 band entries, a third band product to add (2), and
    # per block a suffix: reversed cumulative sum, add to the prefix (2 x 2C)
    band = b * 40 * c * (3 + 1 + 6 + 2 + 1 + SIGMOID + 1) + b * 3 * 2 * 2 * c + 3 * 3 * 16 * 48
    assert mixer_extra_flops(AFTLocal(c, max_len=40, window=2), long) == {"AFT": band}
    assert RELU6 == 2 and SOFTMAX == 5 and SIGMOID == 3


def test_extras_are_collected_per_block_of_a_model():
    with torch.device("meta"):
        model = vitlab.create_model("aft_simple_mini")
    counts = count_flops(model, (3, 32, 32), batch=3)
    t, c, depth = 1 + 8 * 8, 64, 4
    assert counts.extra_by_kind == {"AFT": depth * 11 * 3 * t * c}
    assert counts.flops == 2 * counts.macs + counts.extra_flops


def _expected_extra(model, size, batch):
    """Σ of the mixers' own ``extra_flops`` for the calls one forward makes: every block on the model's token
    layout (Refined-ViT's chained map from block 1 on), every T2T token layer on its soft split's grid."""
    layout = model.forward_trace(torch.empty(1, *size, device="meta"), return_aux=False)["layout"]
    n = layout.num_prefix + layout.grid[0] * layout.grid[1]
    by_label = {}
    for i, blk in enumerate(model.blocks):
        m = blk.mixer
        got = m.extra_flops(batch, n, layout, with_attn_prev=m.uses_attn_prev and i > 0)
        by_label[m.flops_label] = by_label.get(m.flops_label, 0) + got
    t2t = getattr(model, "tokens_to_token", None)
    for layer, (gh, gw) in zip(t2t.layers if t2t else (), t2t.grids(size[1:]) if t2t else ()):
        m = layer.attn
        by_label[m.flops_label] = by_label.get(m.flops_label, 0) + m.extra_flops(batch, gh * gw)
    return by_label


@pytest.mark.parametrize("kind", list(MIXERS))
def test_model_flops_are_twice_the_macs_plus_the_mixers_own_extras(kind):
    """For every registered mixer kind: FLOPs = 2 x MACs + Σ over the model's mixers of their ``extra_flops``."""
    spec = (kind, {"num_heads": 1}) if kind == "external" else kind  # single-head EA: Algorithm 1
    with torch.device("meta"):
        model = vitlab.create_model("deit_mini", mixer=spec)
    size = tuple(model.meta["input_size"])
    counts = count_flops(model, size, batch=2)
    assert counts.extra_by_kind == _expected_extra(model, size, 2)
    assert counts.flops == 2 * counts.macs + counts.extra_flops and counts.extra_flops > 0
    assert counts.macs == count_macs(model, size, batch=2).total


@pytest.mark.parametrize(
    "name, kw", [("refiner_vit_mini", {}), ("eamlp_mini", {}), ("eamlp_mini", {"token_mixer": "attention"})]
)
def test_model_flops_of_chained_maps_and_t2t_token_layers(name, kw):
    """Refined-ViT's shared blocks (the previous map) and the T2T token layers' own mixers, in eval and training."""
    with torch.device("meta"):
        model = vitlab.create_model(name, **kw)
    size = tuple(model.meta["input_size"])
    for training in (False, True):
        model.train(training)
        counts = count_flops(model, size, batch=3)
        assert counts.extra_by_kind == _expected_extra(model, size, 3)
        assert counts.flops == 2 * counts.macs + counts.extra_flops


# ----------------------------------------------------------------------------- GEMM yardstick, utilisation


def test_gemm_rate_is_the_best_median_shape(monkeypatch):
    rate = measure_gemm("fp32", threads=1, shapes=((64, 32, 48), (96, 64, 32)), min_calls=3, min_time=0.01)
    assert rate.flops_per_s == max(rate.by_shape.values()) > 0
    assert set(rate.by_shape) == {"64x32x48", "96x64x32"} and rate.threads == 1
    with pytest.raises(ValueError, match="dtype"):
        measure_gemm("fp64")
    # the yardstick is the median of single calls (not the best call): calls taking 1, 2, 4 s give the 2 s rate
    import vitlab.measure.gemm as gemm

    clock = iter([0.0, 0.0, 1.0, 10.0, 12.0, 20.0, 24.0, 30.0])  # start, (t0, t1) per call, the end check
    monkeypatch.setattr(gemm.time, "perf_counter", lambda: next(clock))
    rate = gemm.shape_rate(8, 8, 8, min_calls=3, min_time=0.0)
    assert rate == pytest.approx(2 * 8**3 / 2.0)


def test_derive_uses_the_median_call_and_the_run_best_gemm():
    def result(rate, calls):
        return {
            "status": "ok",
            "mode": "infer",
            "dtype": "fp32",
            "batch": 4,
            "count": {"model_flops": 8e9},
            "time_s": {"median": 9.0},
            "info": {"calls": calls, "gemm": {"flops_per_s": rate}},
        }

    r, other = result(1e10, [5.0, 1.0, 2.0, 4.0]), result(2e10, [1.0, 1.0])
    bench.derive(r)
    assert r["time_s"]["median"] == 2.0 and r["throughput"] == 2.0  # the warm call is dropped
    assert r["util_case"] == r["util"] == 0.4
    bench.derive(other)
    bench.add_run_utilisation([r, other])
    assert r["util"] == 0.2 and r["util_case"] == 0.4 and r["gemm_run_flops_per_s"] == 2e10


def test_unknown_model_and_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="closest: deit_small"):
        bench.resolve(_args("deit_smal_patch16_224"))
    with pytest.raises(SystemExit):  # checked while parsing (vitlab.common.options)
        _args("deit_mini", "--batch", "0")
    with pytest.raises(ValueError, match="name at least one model"):
        bench.resolve(_args())


def _args(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_wait_policy_default_inherits_the_environment(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert bench.apply_wait_policy(None) is None
    assert bench.apply_wait_policy("passive") == "PASSIVE"
    assert bench.apply_wait_policy(None) == "PASSIVE"  # set now: inherited
    assert bench.apply_wait_policy("inherit") == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert bench.apply_wait_policy("inherit") is None


def test_cli_run_writes_table_json_csv_png(tmp_path, monkeypatch):
    from vitlab.cli import main

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # inherited by the cases; restored after the test
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "deit_mini",
            "--img-size",
            "32",
            "--batch",
            "2",
            "--repeats",
            "1",
            "--gemm-rounds",
            "1",
            "--profile",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    doc = json.loads((out / "bench.json").read_text())
    (case,) = doc["cases"]
    assert case["status"] == "ok", case.get("reason")
    assert case["tokens"] == 65 and case["img_size"] == 32
    assert case["count"]["model_flops"] == 2 * case["count"]["macs"] > 0
    assert case["throughput"] > 0 and case["util"] > 0 and case["gemm_flops_per_s"] > 0
    assert case["mem"]["peak"] >= case["mem"]["baseline"] > 0
    assert math.isclose(case["throughput"], 2 / case["time_s"]["median"])
    with open(out / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["model"] == "deit_mini" and float(rows[0]["util_pct"]) > 0
    for png in ("throughput.png", "memory.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "util %" in (out / "bench.txt").read_text()
    assert doc["machine"]["omp_wait_policy"] == "PASSIVE"
    assert case["mem_timed"]["allocator"] == "keep" and doc["config"]["allocator"] == "keep"
    prof = case["info"]["profile"]
    assert prof["groups"]["gemm"]["flops"] > 0 and prof["gemm_util"] > 0 and prof["ceiling_util"] > 0
    assert math.isclose(sum(g["share"] for g in prof["groups"].values()), 1.0)
    assert "matrix products run at" in (out / "profile_deit_mini_infer_fp32_b2_32px.txt").read_text()


def test_profile_groups_and_counts_flops():
    from vitlab.measure.profile import group_of, op_flops, profile_call, with_yardstick

    assert op_flops("aten::addmm", [[64], [32, 16], [16, 64]]) == 2 * 32 * 16 * 64
    assert op_flops("aten::bmm", [[4, 8, 16], [4, 16, 5]]) == 2 * 4 * 8 * 16 * 5
    assert (
        op_flops("aten::_scaled_dot_product_flash_attention_for_cpu", [[2, 3, 10, 8], [2, 3, 12, 8], [2, 3, 12, 8]])
        == 4 * 2 * 3 * 10 * 12 * 8
    )
    assert op_flops("aten::add", [[3], [3]]) == 0.0
    assert [
        group_of(n) for n in ("aten::mm", "aten::_softmax", "aten::native_layer_norm", "aten::copy_", "aten::gelu")
    ] == ["gemm", "attention", "norm", "copy", "elementwise"]
    a, b, x = torch.randn(64, 48), torch.randn(48, 80), torch.randn(8, 32)
    prof = profile_call(lambda: (torch.mm(a, b), x.softmax(-1), torch.nn.functional.layer_norm(x, (32,)), x.exp()))
    g = prof["groups"]
    assert g["gemm"]["flops"] == 2 * 64 * 48 * 80 and g["gemm"]["calls"] == 1
    assert g["attention"]["ms"] > 0 and g["norm"]["ms"] > 0 and g["elementwise"]["ms"] > 0
    full = with_yardstick(prof, gemm_flops_per_s=1e9, model_flops=2 * 64 * 48 * 80)
    assert math.isclose(full["gemm_util"], g["gemm"]["gflops_per_s"])  # 1 GFLOP/s yardstick


# ----------------------------------------------------------------------------- fast inference paths


def _randomise_batchnorms(module: torch.nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.normal_()
            m.bias.data.normal_()


def _fast_and_reference(module: torch.nn.Module, *args, **kw):
    """The module's output with autograd off (its fast inference path) and on (the reference path)."""
    with torch.no_grad():
        fast = module(*args, **kw)
    return fast, module(*args, **kw)


@pytest.mark.parametrize(
    "r, k, dla, reduction, extras, share",
    [
        (3, 3, True, True, True, True),
        (3, 2, True, True, True, False),
        (1, 3, True, False, True, True),
        (3, 3, False, True, False, False),
        (2, 5, True, False, False, True),
        (1, 1, True, True, True, True),
    ],
)
def test_refiner_inference_path_is_the_same_function(r, k, dla, reduction, extras, share):
    torch.manual_seed(r * 10 + k)
    m = RefinerAttention(
        24,
        2,
        expansion=r,
        kernel_size=k,
        dla=dla,
        reduction=reduction,
        official_extras=extras,
        share=share,
        residual_attention=True,
    ).eval()
    _randomise_batchnorms(m)
    x, prev = torch.randn(3, 10, 24), torch.randn(3, 2, 10, 10).softmax(-1)
    (fast, fast_aux), (ref, ref_aux) = _fast_and_reference(m, x, attn_prev=prev, return_aux=True)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_aux["attn"], ref_aux["attn"], rtol=1e-5, atol=1e-6)


def test_refiner_inference_chunks_the_batch():
    torch.manual_seed(0)
    dla = DistributedLocalAttention(2, 3, 3, official_extras=True).eval()
    _randomise_batchnorms(dla)
    dla._CHUNK_BYTES = 1  # one sample per chunk
    a = torch.randn(5, 2, 7, 7).softmax(-1)
    fast, ref = _fast_and_reference(dla, a)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform_scale", [False, True])
def test_reattention_inference_path_is_the_same_function(transform_scale):
    torch.manual_seed(1)
    m = ReAttention(32, 4, transform_scale=transform_scale).eval()
    _randomise_batchnorms(m)
    x = torch.randn(2, 9, 32)
    (fast, fast_aux), (ref, ref_aux) = _fast_and_reference(m, x, return_aux=True)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast_aux["attn"], ref_aux["attn"], rtol=1e-5, atol=1e-6)


def test_external_inference_path_is_the_same_function():
    torch.manual_seed(2)
    m = MultiHeadExternalAttention(32, 2).eval()
    for p in m.parameters():
        p.data.normal_(0, 0.5)  # non-zero memory biases: one is cancelled, the other moves into proj
    x = torch.randn(2, 9, 32)
    (fast, fast_aux), (ref, ref_aux) = _fast_and_reference(m, x, return_aux=True)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_aux["memory_attn"], ref_aux["memory_attn"], rtol=1e-5, atol=1e-7)


def test_stem_inference_path_and_block_folds_are_the_same_function():
    torch.manual_seed(3)
    stem = PatchEmbed(16, 3, 32, (8, 16)).eval()
    _randomise_batchnorms(stem)
    x = torch.randn(2, 3, 32, 32)
    (fast, _), (ref, _) = _fast_and_reference(stem, x)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    assert fast.is_contiguous()
    blk = Block(32, Attention(32, 4), residual_scale=0.5, ls_init=(None, 0.1)).eval()
    t = torch.randn(2, 5, 32)
    s = 0.5  # the block written out: x += mixer(LN(s·x)) / s; x += γ ⊙ MLP(LN(s·x)) / s
    y = t + blk.mixer(blk.norm1(s * t)) / s
    y = y + blk.ls2.gamma * blk.mlp(blk.norm2(s * y)) / s
    torch.testing.assert_close(blk(t, None), y, rtol=1e-5, atol=1e-6)
