"""timm's names that vitlab's model descriptions use: the fields of timm 1.0's ``PretrainedCfg`` and the
architecture under which vitlab's models live in timm's registry. Imports nothing."""

#: the prefix of vitlab's models in timm's registry (``vitlab.interop.timm``): ``vitlab.<name>``
TIMM_ARCH = "vitlab"
#: timm 1.0's ``PretrainedCfg`` fields (timm reads them from ``model.pretrained_cfg``; a vitlab model has them all)
TIMM_CFG_KEYS = (
    "url",
    "file",
    "state_dict",
    "hf_hub_id",
    "hf_hub_filename",
    "source",
    "architecture",
    "tag",
    "custom_load",
    "input_size",
    "test_input_size",
    "min_input_size",
    "fixed_input_size",
    "interpolation",
    "crop_pct",
    "test_crop_pct",
    "crop_mode",
    "mean",
    "std",
    "num_classes",
    "label_offset",
    "label_names",
    "label_descriptions",
    "pool_size",
    "test_pool_size",
    "first_conv",
    "classifier",
    "license",
    "description",
    "origin_url",
    "paper_name",
    "paper_ids",
    "notes",
)
