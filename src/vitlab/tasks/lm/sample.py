"""Samples of a causal model (``vitlab lm sample``): text started from a prompt, or images drawn or completed
from their first rows, written as text or as one PNG grid."""

from __future__ import annotations

from pathlib import Path

import torch

from ...common.device import resolve_device
from ...common.io import atomic_open
from .data import sequences_to_images
from .decode import generate
from .train import checkpoint_data, load_lm


def sample(
    checkpoint: str,
    num: int = 4,
    length: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    prompt: str | None = None,
    prompt_rows: int | None = None,
    data: str | None = None,
    out: str | None = None,
    device: str = "auto",
) -> list[str]:
    """Draw ``num`` samples from the model saved at ``checkpoint``; the lines that report them (the samples
    themselves for text without ``out``). An image model writes a PNG grid (``out``, or ``samples.png`` beside
    the checkpoint); ``prompt_rows`` completes held-out test images from their first rows."""
    model, ckpt = load_lm(checkpoint)
    dev = resolve_device(device)
    model.to(dev)
    info = ckpt["data"]
    gen = torch.Generator(device=dev).manual_seed(seed)
    images = info["kind"] == "images"
    if prompt_rows and not images:
        raise ValueError("--prompt-rows completes images, but this is a text model; start the samples with --prompt")
    if prompt is not None and images:
        raise ValueError("--prompt starts text, but this is an image model; complete images with --prompt-rows")
    if images:
        size, ch = tuple(info["size"]), info["channels"]
        start = None
        if prompt_rows:
            if not 0 < prompt_rows < size[0]:
                raise ValueError(f"--prompt-rows must be in [1, {size[0] - 1}], got {prompt_rows}")
            seqs = next(checkpoint_data(ckpt, data).eval_batches("test", num))
            start = seqs[:, : prompt_rows * size[1] * ch].long()
        k = 0 if start is None else start.shape[1]
        length = length or info["seq_len"] - k
        if k + length != info["seq_len"]:
            raise ValueError(f"an image needs {info['seq_len']} symbols; got prompt {k} + length {length}")
        seq = generate(model, length, start, num, temperature, top_k, gen)
        path = Path(out) if out else Path(ckpt["path"]).with_name("samples.png")
        save_grid(sequences_to_images(seq.cpu().to(torch.uint8), size, ch), path)
        return [f"wrote {path} ({num} samples{f', completed from {prompt_rows} rows' if k else ''})"]
    start = torch.tensor(list(prompt.encode()))[None].repeat(num, 1) if prompt else None
    length = length or min(200, model.max_len - (0 if start is None else start.shape[1]))
    seq = generate(model, length, start, num, temperature, top_k, gen)
    texts = [bytes(row.tolist()) for row in seq.cpu().to(torch.uint8)]
    if out:
        with atomic_open(out, "wb") as f:
            f.write(b"\n\n".join(texts) + b"\n")
        return [f"wrote {out}"]
    return [f"--- sample {i}\n{t.decode('utf-8', errors='replace')}" for i, t in enumerate(texts)]


def save_grid(images, path: Path, scale: int | None = None) -> None:
    """uint8 images (N, C, H, W) as one PNG row grid, upscaled (nearest) so small images stay visible."""
    from PIL import Image

    n, c, h, w = images.shape
    scale = scale or max(1, 96 // max(h, w))
    cols = min(n, 8)
    rows = -(-n // cols)
    grid = images.new_full((c, rows * (h + 1) + 1, cols * (w + 1) + 1), 255)
    for i, img in enumerate(images):
        r, col = divmod(i, cols)
        grid[:, 1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + col * (w + 1) : 1 + col * (w + 1) + w] = img
    arr = grid.permute(1, 2, 0).numpy()
    pil = Image.fromarray(arr[..., 0] if c == 1 else arr, "L" if c == 1 else "RGB")
    pil = pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST)
    with atomic_open(path, "wb") as f:
        pil.save(f, format=Image.registered_extensions().get(path.suffix.lower(), "PNG"))
