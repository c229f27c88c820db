"""Image generation: a SAGAN-style GAN whose attention layer is SAGAN's self-attention, external attention or
none (:mod:`.model`), its training loop (:mod:`.train`) and FID through torchmetrics with a torchvision-free
Inception-v3 (:mod:`.fid`, :mod:`.inception`). ``vitlab gan train | fid``; docs/gan.md."""

from .model import ATTENTIONS, GAN_SIZES, Discriminator, Generator, build_gan, d_hinge_loss, g_hinge_loss

__all__ = ["ATTENTIONS", "GAN_SIZES", "Discriminator", "Generator", "build_gan", "d_hinge_loss", "g_hinge_loss"]
