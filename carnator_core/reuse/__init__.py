"""Latent reuse for one request: settings, the probe plan, probe signals, the run and its recording."""
