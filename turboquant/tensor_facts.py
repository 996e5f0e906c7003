"""Host-side facts about tensors: a value per tensor, keyed by its device and address, kept for as
long as that tensor (or the tensor it is a view of) lives. The API keeps a cache's config this
way (``api.cache_config``), the shared state whether a layer's smoothing is set
(``shared_state.take_smoothing``): reading a fact reads nothing from the device."""
from __future__ import annotations

import weakref

import torch


class TensorFacts:
    def __init__(self):
        self._facts: dict = {}

    @staticmethod
    def key(t: torch.Tensor) -> tuple:
        """What identifies ``t`` here: its device and address."""
        return (str(t.device), t.data_ptr())

    def get(self, t: torch.Tensor, default=None):
        return self._facts.get(self.key(t), default)

    def set(self, t: torch.Tensor, value) -> None:
        """Record ``value`` for ``t``; dropped when t (its base) is freed."""
        key = self.key(t)
        if key not in self._facts:
            anchor = t._base if t._base is not None else t
            weakref.finalize(anchor, self._facts.pop, key, None)
        self._facts[key] = value
