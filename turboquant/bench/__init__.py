"""The lab beside the library: ``python -m turboquant bench`` (``run``: decode, prefill and
writer rows against PyTorch SDPA and, with ``--peers``, FlashInfer; ``multitoken``: the
multi-token rows), what it times (``problems``), how (``timing``), how it reports (``report``),
and the peers' caches and calls (``peers``). Nothing in the library imports this package."""
