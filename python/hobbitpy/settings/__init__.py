"""Every setting, defined once: the offload configuration, the presets, the generation defaults."""
