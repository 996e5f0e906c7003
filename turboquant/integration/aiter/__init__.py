"""AITER integration: ``python -m turboquant.integration.aiter.patch --aiter-root PATH`` injects
turboquant's gfx950 / gfx942 FP4 paged attention (csrc_hip/) and the HIP cache writer (the cuda
writer hipified by turboquant.hip_writer) into an AITER source tree or an installed amd-aiter;
``turboquant._backends.aiter`` calls the patched ops (aiter.paged_attention_fp4,
aiter.reshape_and_cache_fp4)."""
