"""The foundation every layer may use: atomic files (:mod:`.io`), validated options, named registries, optional
extras, the device story, process-wide runtime settings, processes (:mod:`.distributed`), run folders and
reports. Nothing here imports the rest of vitlab."""
