"""Embedded demo text-to-video model: synthetic world, Wan 2.1-architecture DiT, text encoder, training, oracle."""
