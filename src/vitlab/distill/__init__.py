"""Distillation, whole: the teacher (:mod:`.teacher`: a vitlab checkpoint, a ``.pt2`` program or a TorchScript
file, loaded and run), the checker that refuses a teacher file that could run code (:mod:`.safety`), the loss of
DeiT's soft and hard distillation (:mod:`.loss`) and LV-ViT's relabelling into dense token labels
(:mod:`.relabel`)."""
