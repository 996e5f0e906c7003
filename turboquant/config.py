"""Quantization options, one small object a cache is written with and read with.

    QuantConfig()                          # the default: rotation + calibrated key smoothing + sink
    QuantConfig.parse("plain")             # CONTRACT.md section 1 alone: no transform
    QuantConfig.parse("rotation+per32")    # the names used by `python -m turboquant accuracy`

Fields (CONTRACT.md section 2 defines each transform):

- ``scale_group``: None (one E8M0 scale per (token, head)) or 32 (per 32 elements).
- ``scale_rule``: "smallest" (the format's rule) or "mse" (better of two exponents).
- ``rotation``: K, V and Q rotated by a randomized Hadamard matrix (``rotation_seed``).
- ``key_smoothing``: None; "calibrated" (a key center m and per-channel key scale lam per
  layer and kv head: from a calibration file, or taken from the layer's first write); or
  "sequence" (m and lam per sequence, from its first written chunk).
- ``sink``: the first token of every sequence kept beside the FP4 cache (bf16 in the shared
  state, fp32 in a per-sequence record).

Smoothing and the sink keep state. The default keeps it per layer, shared by every sequence
(``turboquant.shared_state``: pass ``shared_state=``; prefix caching, forks and engines without
request slots work unchanged). The per-sequence record (``seq_state``/``state_ids``, one slot per
live sequence, ``turboquant.smoothing``) is the option that "sequence" smoothing needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SCALE_RULES = ("smallest", "mse")
KEY_SMOOTHINGS = (None, "calibrated", "sequence")
# QuantConfig.parse names: part -> (field, value); "plain" turns every transform off.
_PARTS = {"rotation": ("rotation", True), "per32": ("scale_group", 32),
          "mse": ("scale_rule", "mse"), "smooth": ("key_smoothing", "sequence"),
          "calibrated": ("key_smoothing", "calibrated"), "sink": ("sink", True)}
_PLAIN = {"rotation": False, "key_smoothing": None, "sink": False}


@dataclass(frozen=True)
class QuantConfig:
    scale_group: Optional[int] = None  # None: one scale per (token, head); 32: per 32 elements
    rotation: bool = True  # rotate K, V and Q by a randomized Hadamard matrix (head dim)
    rotation_seed: int = 0  # seed of the rotation's random signs
    scale_rule: str = "smallest"  # "smallest" (CONTRACT.md) or "mse" (better of two exponents)
    key_smoothing: Optional[str] = "calibrated"  # None, "calibrated" (per layer) or "sequence"
    sink: bool = True  # the first token of a sequence kept beside the FP4 cache

    def __post_init__(self):
        if self.scale_group not in (None, 32):
            raise ValueError(f"scale_group: expected None or 32, got {self.scale_group!r}")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule: expected one of {SCALE_RULES}, "
                             f"got {self.scale_rule!r}")
        if self.key_smoothing not in KEY_SMOOTHINGS:
            raise ValueError(f"key_smoothing: expected one of {KEY_SMOOTHINGS}, "
                             f"got {self.key_smoothing!r}")
        if not isinstance(self.rotation_seed, int) or not 0 <= self.rotation_seed < 2 ** 63:
            raise ValueError(f"rotation_seed: expected an int in [0, 2^63), "
                             f"got {self.rotation_seed!r}")

    @property
    def uses_state(self) -> bool:
        """Whether the writer and reader keep state: ``shared_state`` (or ``seq_state``)."""
        return self.key_smoothing is not None or self.sink

    @property
    def shares_state(self) -> bool:
        """Whether the state is the layer's shared state (``shared_state``): every config that
        keeps state but "sequence" smoothing (the default does)."""
        return self.uses_state and not self.needs_slots

    @property
    def needs_slots(self) -> bool:
        """Whether the state must be the per-sequence record (``seq_state``/``state_ids``):
        "sequence" key smoothing; every other config runs with the shared state."""
        return self.key_smoothing == "sequence"

    @property
    def name(self) -> str:
        extra = (["per32"] if self.scale_group == 32 else []) + \
                (["mse"] if self.scale_rule == "mse" else [])
        if self == QuantConfig(scale_group=self.scale_group, scale_rule=self.scale_rule,
                               rotation_seed=self.rotation_seed):
            base = ["default"]
        else:
            base = [part for part, (field, value) in _PARTS.items()
                    if field not in ("scale_group", "scale_rule")
                    and getattr(self, field) == value]
        return "+".join(base + extra) or "plain"

    @classmethod
    def parse(cls, name: str) -> "QuantConfig":
        """'default' (the default config), 'plain' (no transform) or '+'-joined parts of
        'rotation', 'per32', 'mse', 'smooth', 'calibrated', 'sink'; 'default+per32' adds a
        part to the default, 'per32' alone adds it to 'plain'."""
        parts = name.split("+")
        kwargs = {} if parts[0] == "default" else dict(_PLAIN)
        for part in parts:
            if part in ("default", "plain") and part == parts[0]:
                continue
            if part not in _PARTS:
                raise ValueError(f"config: unknown option {part!r} in {name!r}; expected "
                                 f"'default' or 'plain' first, or '+'-joined "
                                 f"{', '.join(repr(p) for p in _PARTS)}")
            field, value = _PARTS[part]
            kwargs[field] = value
        return cls(**kwargs)


DEFAULT = QuantConfig()
PLAIN = QuantConfig.parse("plain")
# the default's transforms with per-sequence key smoothing (the record in seq_state)
PER_SEQUENCE = QuantConfig(key_smoothing="sequence")

KEY_FORMATS = ("fp4", "fp8_e4m3")


def parse_cache_format(name: str) -> tuple:
    """A cache format by name -> (QuantConfig, key_format): a QuantConfig name (FP4 keys), or
    ``k8v4`` (E4M3 keys, FP4 values, the default config) / ``k8v4/NAME`` (config ``NAME``).
    K8V4 has one scale per (token, head), so its configs cannot ask for per-32 scales."""
    if name == "k8v4" or name.startswith("k8v4/"):
        config = QuantConfig.parse(name.partition("/")[2] or "default")
        if config.scale_group is not None:
            raise ValueError(f"format {name!r}: a K8V4 cache has one scale per (token, head), "
                             f"not per {config.scale_group} elements")
        return config, "fp8_e4m3"
    return QuantConfig.parse(name), "fp4"
