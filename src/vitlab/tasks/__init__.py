"""The tasks beyond image classification, each whole in its folder (data, model, metrics, engine hooks):
:mod:`.segmentation` (VOC / ADE20K masks), :mod:`.points` (ModelNet40 / ShapeNet-Part point clouds) and
:mod:`.lm` (AFT's causal models on bytes and CIFAR-10 sub-pixels). A task package registers its hooks with the
training engine when it is imported (:func:`vitlab.engine.tasks.register_task`)."""
