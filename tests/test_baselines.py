"""The AFT paper's baseline mixers against direct float64 implementations of their papers' equations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vitlab.mixers import BASELINE_MIXERS, TokenLayout, build
from vitlab.mixers.base import merge_heads, split_heads
from vitlab.mixers.lsh_attention import SELF_LOGIT, lsh_buckets
from vitlab.mixers.random_features import orthogonal_gaussian

D, H = 16, 2


def heads_of(mixer, x):
    q, k, v = mixer.qkv(x).chunk(3, -1)
    return split_heads(q, H), split_heads(k, H), split_heads(v, H)


def normalised_mix(weights, v, mixer):
    """``proj(merge_h(Σ_j w_ij v_j / Σ_j w_ij))`` for unnormalised weights (B, H, N, N)."""
    return mixer.proj(merge_heads((weights @ v) / weights.sum(-1, keepdim=True)))


def causal_mask(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [7, 70])  # 70: a causal form over two chunks of 64 and padding
def test_linear_transformer_equals_its_equation(causal, n):
    torch.manual_seed(0)
    m = build("linear_attention", D, num_heads=H, causal=causal).double()
    x = torch.randn(2, n, D, dtype=torch.float64)
    q, k, v = heads_of(m, x)

    def phi(t):  # elu(x) + 1
        return torch.where(t > 0, t + 1, t.exp())

    weights = phi(q) @ phi(k).transpose(-2, -1)  # φ(q_i)·φ(k_j), Katharopoulos Eq. 4
    if causal:
        weights = weights * causal_mask(n)
    torch.testing.assert_close(m(x), normalised_mix(weights, v, m))


def test_performer_with_fixed_features_equals_the_favor_formula():
    torch.manual_seed(0)
    m = build("performer", D, num_heads=H, causal=True, num_features=24).double().eval()
    x = torch.randn(2, 70, D, dtype=torch.float64) * 2
    q, k, v = heads_of(m, x)
    w = m.projection.double()  # (m, d)
    d = D // H

    def phi(t):  # exp(ω·x̃ - |x̃|²/2)/√m, x̃ = x / d^(1/4) (Performer Lemma 1)
        t = t / d**0.25
        return torch.exp(t @ w.T - (t * t).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[0])

    weights = (phi(q) @ phi(k).transpose(-2, -1)) * causal_mask(70)
    torch.testing.assert_close(m(x), normalised_mix(weights, v, m))


def test_performer_estimate_converges_to_softmax_attention():
    """Relative error of FAVOR+ against exact softmax attention falls as the features grow (fixed seed; a biased
    draw, e.g. QR without the sign correction, stalls at a few percent)."""
    torch.manual_seed(0)
    errors = []
    for features in (16, 256, 4096):
        m = build("performer", D, num_heads=H, num_features=features).double().eval()
        torch.manual_seed(1)
        x = torch.randn(2, 20, D, dtype=torch.float64) * 0.5
        torch.manual_seed(2)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.2)
        q, k, v = heads_of(m, x)
        exact = normalised_mix(torch.exp(q @ k.transpose(-2, -1) / math.sqrt(D // H)), v, m)
        errors.append(((m(x) - exact).norm() / exact.norm()).item())
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.02, errors


def test_orthogonal_features_and_redraw_schedule():
    w = orthogonal_gaussian(20, 8, torch.Generator().manual_seed(0)).double()
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(8, dtype=torch.float64))
    torch.manual_seed(0)
    m = build("performer", D, num_heads=H, num_features=8, redraw_every=2).train()
    x = torch.randn(1, 5, D)
    first = m.projection.clone()
    m(x)
    assert torch.equal(m.projection, first)  # forward 0 keeps draw 0
    m(x)
    assert torch.equal(m.projection, first)
    m(x)  # forward 2: draw 1
    assert not torch.equal(m.projection, first)
    torch.testing.assert_close(m.projection, m.draw(1))
    m.eval()
    drawn = m.projection.clone()
    m(x)
    assert torch.equal(m.projection, drawn)  # evaluation never redraws
    # the draws depend on the saved seed and the count only: a copy loaded from the state dict redraws the same
    twin = build("performer", D, num_heads=H, num_features=8, redraw_every=2)
    twin.load_state_dict(m.state_dict())
    torch.testing.assert_close(twin.draw(5), m.draw(5))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["synthesizer_dense", "synthesizer_random"])
def test_synthesizer_equals_its_equation(kind, causal):
    torch.manual_seed(0)
    n = 9
    m = build(kind, D, num_heads=H, max_len=12, causal=causal).double()
    x = torch.randn(2, n, D, dtype=torch.float64)
    if kind == "synthesizer_dense":  # B_i = W2 relu(W1 x_i + b1) + b2, one row of max_len logits per head
        lin1, lin2 = m.synth[0], m.synth[2]
        b = F.linear(torch.relu(F.linear(x, lin1.weight, lin1.bias)), lin2.weight, lin2.bias)
        logits = b.view(2, n, H, 12).permute(0, 2, 1, 3)[..., :n]
    else:
        logits = m.random_logits[:, :n, :n].unsqueeze(0)
    weights = logits.exp() * (causal_mask(n) if causal else 1)
    v = split_heads(m.value(x), H)
    torch.testing.assert_close(m(x), normalised_mix(weights, v, m))
    with pytest.raises(ValueError, match="max_len"):
        m(torch.randn(1, 13, D, dtype=torch.float64))


def sparse_reference(q, k, v, allowed_fn, scale):
    """Child et al. Eq. 2 by loops: each query's softmax over its own key set."""
    out = torch.zeros_like(q)
    n = q.shape[2]
    for i in range(n):
        keys = [j for j in range(n) if allowed_fn(i, j)]
        logits = (q[:, :, i : i + 1] @ k[:, :, keys].transpose(-2, -1)) * scale
        out[:, :, i] = (logits.softmax(-1) @ v[:, :, keys])[:, :, 0]
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", ["local", "strided"])
def test_sparse_attention_equals_its_pattern(pattern, causal):
    torch.manual_seed(0)
    n, width, prefix = 21, 4, 1
    kind = f"{pattern}_attention"
    m = build(kind, D, num_heads=H, causal=causal, **({"window": width} if pattern == "local" else {"stride": width}))
    m = m.double()
    x = torch.randn(2, n, D, dtype=torch.float64)
    q, k, v = heads_of(m, x)

    def allowed(i, j):
        if causal and j > i:
            return False
        if i < prefix or j < prefix:
            return True
        return abs(i - j) < width or (pattern == "strided" and (i - j) % width == 0)

    expected = m.proj(merge_heads(sparse_reference(q, k, v, allowed, m.scale)))
    layout = TokenLayout.sequence(prefix)
    torch.testing.assert_close(m(x, layout), expected)  # SDPA with the mask
    torch.testing.assert_close(m(x, layout, return_aux=True)[0], expected)  # the explicit map


def lsh_reference(mixer, x):
    """Reformer by its sets: per round, P_i = keys of i's bucket in i's chunk of the (bucket, position) order or
    the chunk before, j ≤ i when causal; i itself at logit -1e5; rounds weighted by their logsumexp."""
    qk, v = split_heads(mixer.qk(x), H), split_heads(mixer.v(x), H)
    keys = qk / qk.norm(dim=-1, keepdim=True)
    buckets = lsh_buckets(keys, mixer.rotations.double())  # (B, H, R, N)
    b, h, r, n = buckets.shape
    c = mixer.chunk_size
    chunks = -(-n // c)
    out = torch.zeros(b, h, n, qk.shape[-1], dtype=x.dtype)
    for bi in range(b):
        for hi in range(h):
            per_round, lses = [], []
            for ri in range(r):
                bk = buckets[bi, hi, ri].tolist()
                rank = {p: s for s, p in enumerate(sorted(range(n), key=lambda p: (bk[p], p)))}
                outs, lse = [], []
                for i in range(n):
                    near = {rank[i] // c, (rank[i] // c - 1) % chunks}
                    js = [
                        j for j in range(n) if rank[j] // c in near and bk[j] == bk[i] and (not mixer.causal or j <= i)
                    ]
                    logits = torch.stack([qk[bi, hi, i] @ keys[bi, hi, j] * mixer.scale for j in js])
                    logits = torch.where(torch.tensor(js) == i, torch.full_like(logits, SELF_LOGIT), logits)
                    outs.append(logits.softmax(0) @ v[bi, hi, js])
                    lse.append(logits.logsumexp(0))
                per_round.append(torch.stack(outs))
                lses.append(torch.stack(lse))
            weights = torch.stack(lses).softmax(0)  # (R, N)
            out[bi, hi] = (weights.unsqueeze(-1) * torch.stack(per_round)).sum(0)
    return mixer.proj(merge_heads(out))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [16, 13])  # 13: the sorted sequence padded to whole chunks
def test_lsh_attention_equals_its_sets(causal, n):
    torch.manual_seed(0)
    m = build("lsh_attention", D, num_heads=H, causal=causal, buckets=4, rounds=2, chunk_size=4).double().eval()
    x = torch.randn(2, n, D, dtype=torch.float64)
    torch.testing.assert_close(m(x), lsh_reference(m, x))


def test_lsh_rotations_redraw_every_training_forward_and_decoding_recomputes():
    torch.manual_seed(0)
    m = build("lsh_attention", D, num_heads=H, causal=True, buckets=4, chunk_size=4).train()
    x = torch.randn(1, 12, D)
    m(x)
    drawn = m.rotations.clone()
    m(x)
    assert not torch.equal(m.rotations, drawn)
    m.eval()
    state = m.init_state(1, 12, x)
    for t in range(12):  # step t = position t of the causal forward on the first t + 1 tokens
        torch.testing.assert_close(m.step(x[:, t], t, state), m(x[:, : t + 1])[:, t])


def lambda_reference(m, x, grid):
    """Bello Eq. 1-3 with the relative embeddings looked up pair by pair; BatchNorm in eval mode."""
    b, n, _ = x.shape

    def bn(t, norm):
        return (t - norm.running_mean) / (norm.running_var + norm.eps).sqrt() * norm.weight + norm.bias

    q = bn(m.to_q(x), m.norm_q).view(b, n, H, m.key_dim)
    keys = m.to_k(x).softmax(1)
    v = bn(m.to_v(x), m.norm_v)
    content = torch.einsum("bmk,bmv->bkv", keys, v)
    kmax = m.max_distance
    coords = [None] + [(p // grid[1], p % grid[1]) for p in range(n - 1)]  # one prefix token
    out = torch.zeros(b, n, H, m.value_dim, dtype=x.dtype)
    for i in range(n):
        emb = torch.stack(
            [
                m.prefix_pos
                if coords[i] is None or coords[j] is None
                else m.rel_pos[
                    max(-kmax, min(kmax, coords[j][0] - coords[i][0])) + kmax,
                    max(-kmax, min(kmax, coords[j][1] - coords[i][1])) + kmax,
                ]
                for j in range(n)
            ]
        )  # E_i (m, k)
        lam = content + torch.einsum("mk,bmv->bkv", emb, v)  # λ^c + λ^p_i
        out[:, i] = torch.einsum("bkv,bhk->bhv", lam, q[:, i])
    out = out.reshape(b, n, -1)
    return m.proj(out) if m.proj is not None else out  # the output projection W_O y_n + b_O


def test_lambda_layer_equals_its_equation():
    torch.manual_seed(0)
    m = build("lambda", D, num_heads=H, key_dim=4, max_distance=2).double().eval()
    for norm in (m.norm_q, m.norm_v):
        norm.running_mean.normal_()
        norm.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 1 + 12, D, dtype=torch.float64)
    layout = TokenLayout((3, 4), 1)
    torch.testing.assert_close(m(x, layout), lambda_reference(m, x, (3, 4)))
    bare = build("lambda", D, num_heads=H, key_dim=4, max_distance=2, out_proj=False).double().eval()
    bare.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("proj.")})
    torch.testing.assert_close(bare(x, layout), lambda_reference(bare, x, (3, 4)))


@pytest.mark.parametrize(
    "kind", ["linear_attention", "performer", "synthesizer_dense", "synthesizer_random", "local_attention"]
)
def test_incremental_decoding_equals_the_causal_forward(kind):
    torch.manual_seed(0)
    m = build(kind, D, defaults={"max_len": 20}, num_heads=H, causal=True).eval()
    x = torch.randn(2, 20, D) * 3
    full = m(x)
    state = m.init_state(2, 20, x)
    steps = torch.stack([m.step(x[:, t], t, state) for t in range(20)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", sorted(BASELINE_MIXERS))
def test_every_baseline_trains_in_a_vision_model(kind):
    """Any mixer in any block: a small ViT with the baseline everywhere runs forward and backward."""
    import vitlab

    torch.manual_seed(0)
    model = vitlab.create_model("aft_simple_mini", num_classes=3, depth=2, img_size=16, mixer=kind)
    x = torch.randn(2, 3, 16, 16)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_bad_options():
    with pytest.raises(ValueError, match="pattern='local'"):
        build("local_attention", D, pattern="strided")
    with pytest.raises(ValueError, match="num_features must be >= 1"):
        build("performer", D, num_features=0)
    with pytest.raises(ValueError, match="buckets must be even"):
        build("lsh_attention", D, buckets=3)
    with pytest.raises(ValueError, match="unknown option"):
        build("lambda", D, causal=True)
    with pytest.raises(ValueError, match="pattern must be one of"):
        from vitlab.mixers import SparseAttention

        SparseAttention(D, pattern="dilated")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(BASELINE_MIXERS))
def test_baselines_on_cuda_match_the_cpu(kind):
    """The same weights and draws give the same outputs and gradients on the GPU (fp32), and under bf16
    autocast the output stays finite (and close, but for LSH)."""
    torch.manual_seed(0)
    causal = {} if kind == "lambda" else {"causal": True}
    cpu = build(kind, D, defaults={"max_len": 40}, num_heads=H, **causal).eval()
    gpu = build(kind, D, defaults={"max_len": 40}, num_heads=H, **causal).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    x = torch.randn(2, 40, D, requires_grad=True)
    xg = x.detach().cuda().requires_grad_()
    out, out_gpu = cpu(x), gpu(xg)
    torch.testing.assert_close(out_gpu.cpu(), out, atol=1e-4, rtol=1e-4)
    out.square().sum().backward()
    out_gpu.square().sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), x.grad, atol=1e-3, rtol=1e-3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        low = gpu(xg)
    assert torch.isfinite(low).all()
    if kind != "lsh_attention":  # rounded keys may hash to other buckets: other sets, another function
        assert (low.float().cpu() - out).abs().max() < 0.1


def test_performer_causal_outputs_ignore_later_keys_of_any_size():
    """A later key whose features dwarf the earlier ones (e^80 larger) must not rescale the earlier positions into
    underflow: their outputs equal those of the forward on the prefix alone."""
    torch.manual_seed(0)
    m = build("performer", D, num_heads=H, causal=True, num_features=16).eval()
    with torch.no_grad():
        m.projection.mul_(4)  # wide directions: a key along one of them has a large exponent
    x = torch.randn(1, 140, D) * 0.3
    x[:, 70:] = torch.randn(1, 70, D) * 6  # later chunks: large keys
    prefix = m(x[:, :70])
    torch.testing.assert_close(m(x)[:, :70], prefix)
    assert torch.isfinite(m(x)).all() and prefix.abs().amax() > 0
