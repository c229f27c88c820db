"""Plug-ins for other libraries: :mod:`.timm` (vitlab's models in timm's registry) and :mod:`.hf` (Hugging
Face ``Trainer``). Neither library is a dependency of vitlab; each module imports its library only when used."""
