"""Helpers shared by the test groups: real ComfyUI hosts, tiny models, graphs, Redis and store writers."""
