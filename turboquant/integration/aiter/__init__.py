"""AITER integration: ``python -m turboquant.integration.aiter.patch --aiter-root PATH`` injects
turboquant's gfx950 / gfx942 FP4 paged attention (csrc_hip/) into an AITER source tree or an installed
amd-aiter; ``turboquant._backends.aiter`` calls the patched op."""
