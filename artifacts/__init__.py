"""The artifacts the stages share through the run directory: the config schema, the cache and its
manifest, the draft vocabulary, the held-out prompts, and the embedded real assets and smoke target."""
