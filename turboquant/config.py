"""Quantization options, one small object a cache is created with and read with.

    QuantConfig()                              # DESIGN.md default: one scale per (token, head)
    QuantConfig(scale_group=32)                # one E8M0 scale per 32 elements (OCP MX block)
    QuantConfig(rotation=True)                 # randomized Hadamard rotation of the head dim
    QuantConfig(scale_rule="mse")              # better of two exponents by squared error
    QuantConfig.parse("rotation+per32")        # the names used by `python -m turboquant accuracy`

The writer needs all of it; the reader needs ``rotation`` (Q is rotated and the output
un-rotated) and finds the scale group from the scale tensors' shape, which must agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SCALE_RULES = ("smallest", "mse")


@dataclass(frozen=True)
class QuantConfig:
    scale_group: Optional[int] = None  # None: one scale per (token, head); 32: per 32 elements
    rotation: bool = False  # rotate K, V and Q by a randomized Hadamard matrix (head dim)
    rotation_seed: int = 0  # seed of the rotation's random signs
    scale_rule: str = "smallest"  # "smallest" (DESIGN.md) or "mse" (better of two exponents)

    def __post_init__(self):
        if self.scale_group not in (None, 32):
            raise ValueError(f"scale_group: expected None or 32, got {self.scale_group!r}")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule: expected one of {SCALE_RULES}, "
                             f"got {self.scale_rule!r}")

    @property
    def name(self) -> str:
        parts = (["rotation"] if self.rotation else []) + \
                (["per32"] if self.scale_group == 32 else []) + \
                (["mse"] if self.scale_rule == "mse" else [])
        return "+".join(parts) or "default"

    @classmethod
    def parse(cls, name: str) -> "QuantConfig":
        """'default', or '+'-joined parts of 'rotation', 'per32', 'mse'."""
        kwargs = {}
        for part in name.split("+"):
            if part == "default":
                continue
            elif part == "rotation":
                kwargs["rotation"] = True
            elif part == "per32":
                kwargs["scale_group"] = 32
            elif part == "mse":
                kwargs["scale_rule"] = "mse"
            else:
                raise ValueError(f"config: unknown option {part!r} in {name!r}; expected "
                                 f"'default' or '+'-joined 'rotation', 'per32', 'mse'")
        return cls(**kwargs)


DEFAULT = QuantConfig()
