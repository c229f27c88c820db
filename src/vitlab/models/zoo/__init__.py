"""Every named vision model, one file per paper: each holds that paper's rows at paper size, its ablation rows
and its small ``*_mini`` rows, and registers them in :mod:`vitlab.models.registry` (where each number comes
from: docs/models.md).

* :mod:`~vitlab.models.zoo.deit`: DeiT-Ti / S / B, with and without distillation token.
* :mod:`~vitlab.models.zoo.deepvit`: DeepViT's ViT-NB baselines, DeepViT-NB and DeepViT-S / L; its depth and
  attention-temperature / dropping-attention study rows.
* :mod:`~vitlab.models.zoo.refiner`: Refined-ViT-S / M / L (224, 384, 448 px), ViTs with DLA on the attention
  maps, ViT-16B with the refiner; its expansion-ratio and DLA-kernel study rows.
* :mod:`~vitlab.models.zoo.cpvt`: CPVT-Ti / S / B (class token or GAP), Twins-PCPVT-S / B / L; the PEG and
  position-encoding study rows.
* :mod:`~vitlab.models.zoo.aft`: AFT-full / AFT-conv on DeiT backbones and AFT-simple / AFT-local; the
  factorisation, re-parameterisation, query, global-connectivity and sparsity ablations.
* :mod:`~vitlab.models.zoo.external`: EAMLP-7 / 14 / 19 and their T2T-ViT-7 / 14 baselines; EA's
  normalisation, BatchNorm and memory-size study rows.
* :mod:`~vitlab.models.zoo.tnt`: TNT-Ti / S / B, partial TNT-S, TNT-S + SE; the position-encoding,
  words-per-patch and inner-heads ablations.
* :mod:`~vitlab.models.zoo.baselines`: the rows of no paper of their own: the Lambda networks of AFT's
  comparison.
* :mod:`~vitlab.models.zoo.cnn`: the convolutional baselines: ResNet-50 / 101 / 152 (and the dilated
  ``resnet50_d8`` / ``resnet101_d8``), RegNetY-4GF / 8GF / 16GF (DeiT's teacher), EfficientNet-B0 .. B4.

:mod:`~vitlab.models.zoo._shared` holds what several of them write their rows with (the VisionTransformer row,
the ``*_mini`` size, DeiT's widths, the ViT-NB backbones of DeepViT and Refiner).

Parameter/MAC targets are for 1000 classes at the default input size. The ``*_mini`` rows are small variants of
each family (patch 4, 32 px input) for CPU training; build them with ``img_size=28, in_chans=1`` for MNIST.

Each row also carries how its official code evaluates (crop fraction, interpolation, normalisation: the
``default_cfgs`` of that code), the ImageNet top-1 its paper or README reports, and where the official
checkpoint is published; these become the model's ``pretrained_cfg``.
"""

# importing a paper file registers its rows
from . import aft, baselines, cnn, cpvt, deepvit, deit, external, refiner, tnt  # noqa: F401
