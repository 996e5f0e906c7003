"""turboquant in transformers: ``model.generate`` (and plain forward calls) with the KV cache held
in turboquant's format, a batch of sequences at once.

    from turboquant.integration.transformers import PagedKVCache
    cache = PagedKVCache(model, batch_size=8, max_length=2048)       # FP4 (or kv_cache_dtype=
    out = model.generate(input_ids, attention_mask=attention_mask,   #   "tq_k8v4")
                         past_key_values=cache, max_new_tokens=128)

The cache holds, per layer, only the format's bytes (``layer_bytes``: num_blocks x num_kv_heads
x block_size x (D + 2) for FP4) and the layer's shared state; no BF16 copy of the keys and values
is kept. Each batch row is a sequence with its own blocks (``block_table``). Making the cache
sets the model's attention implementation to "turboquant": an attention function that writes
each step's keys and values into the cache and runs ``paged_attention_fp4`` over it (the engine
layer of the vLLM plugin, ``integration.vllm.layer.PagedLayer``), and a mask function that hands
it the padding mask, so left-padded batches work: padding tokens are not written, each row's
positions count its own tokens. The step's plan (which tokens are real, their slots and
positions) is made once per forward, at the first layer. Queries of 32-bit models are rounded to
bf16 for the kernels and the outputs returned in the model's dtype.

Supported: decoder models whose every layer is attention with 64, 128 or 256 head dims (Llama,
Qwen, Mistral, SmolLM, Gemma 2/3 with their sliding windows and soft caps, gpt-oss's sinks);
greedy and sampled generation. Not supported: beam search (reordering rows), ``crop``
(assisted decoding), caches shared between models.
"""
from __future__ import annotations

import contextvars
import math
from typing import Optional, Sequence

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from .vllm.layer import KEY_FORMATS, PagedLayer, StepMetadata, bytes_per_token_head

NAME = "turboquant"
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("turboquant_cache", default=None)


def padding_mask(batch_size: int, q_length: int, kv_length: int, *, attention_mask=None,
                 **kwargs) -> Optional[torch.Tensor]:
    """transformers' mask function for "turboquant": the 2D padding mask, bool
    [batch, kv_length] (None: no padding); causality and windows are the kernels'."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask[:, -kv_length:].bool()


class _CountingLayer(CacheLayerMixin):
    """One layer's entry in transformers' Cache: counts the positions written (transformers'
    masks and cache positions read it); the keys and values go to the PagedKVCache."""

    is_sliding = False

    def __init__(self, cache: "PagedKVCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx, self.seen = cache, layer_idx, 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        self.cache._updated = self.layer_idx
        _ACTIVE.set(self.cache)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.cache.max_length

    def reset(self) -> None:
        self.seen = 0

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("beam search: PagedKVCache does not reorder its rows")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop: PagedKVCache does not remove tokens")


class EngineLayers:
    """What both transformers paths (``PagedKVCache``, ``transformers_batching``) share: each
    layer's engine layer, made at its first call from what transformers passes the attention
    function (scaling, sliding window, soft cap, sinks), and the call itself."""

    def __init__(self, head_dim: int, num_kv_heads: int, key_format: str,
                 calibration: Optional[Sequence[tuple]], sink_entries: Optional[int]):
        self.head_dim, self.num_kv_heads, self.key_format = head_dim, num_kv_heads, key_format
        self.calibration, self.sink_entries = calibration, sink_entries
        self.layers: dict = {}  # layer index -> PagedLayer

    def run(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            kv_cache: torch.Tensor, meta: StepMetadata, idx: Optional[torch.Tensor],
            scaling: Optional[float], sliding_window, softcap, sinks) -> torch.Tensor:
        """query [batch, Hq, q_len, D], key and value [batch, Hkv, q_len, D]; ``idx`` the rows
        of the batch x q_len tokens the step holds (None: all) -> [batch, q_len, Hq, D], zero in
        the other rows. Queries of 32-bit models are rounded to bf16 for the kernels."""
        batch, num_heads, q_len, d = query.shape
        layer = self.layers.get(layer_idx)
        if layer is None:
            cal = self.calibration[layer_idx] if self.calibration is not None else None
            layer = PagedLayer(num_heads, self.head_dim, self.num_kv_heads,
                               scaling if scaling is not None else d ** -0.5,
                               key_format=self.key_format, sliding_window=sliding_window or 0,
                               logits_soft_cap=softcap or 0.0, sinks=sinks, calibration=cal,
                               sink_entries=self.sink_entries)
            self.layers[layer_idx] = layer
        dtype = query.dtype if query.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16

        def packed(t):  # [batch, H, q_len, D] -> the step's rows [n, H, D]
            t = t.transpose(1, 2).reshape(batch * q_len, t.shape[1], d)
            return (t if idx is None else t[idx]).to(dtype)

        q = packed(query)
        out = torch.empty_like(q)
        layer.forward(q, packed(key), packed(value), kv_cache, meta, out)
        if idx is None:
            return out.to(query.dtype).view(batch, q_len, num_heads, d)
        full = query.new_zeros(batch * q_len, num_heads, d)
        full[idx] = out.to(query.dtype)
        return full.view(batch, q_len, num_heads, d)


class PagedKVCache(Cache):
    """A batch's KV cache in turboquant's format, for ``model.generate(past_key_values=...)``:
    ``batch_size`` rows of up to ``max_length`` tokens each; ``calibration`` per layer (m, lam)
    (``turboquant.load_calibration``; None: taken by the first write); ``sink_entries`` per
    layer's sink table (None: the shared state's default, ceil(blocks / 16): two rows whose
    first tokens share an entry read one of them from its FP4 bytes, a small accuracy cost)."""

    def __init__(self, model, batch_size: int, max_length: int, *,
                 kv_cache_dtype: str = "tq_fp4", block_size: int = 16,
                 calibration: Optional[Sequence[tuple]] = None,
                 sink_entries: Optional[int] = None, device=None):
        cfg = model.config.get_text_config()
        if kv_cache_dtype not in KEY_FORMATS:
            raise ValueError(f"kv_cache_dtype: expected one of {sorted(KEY_FORMATS)}, got "
                             f"{kv_cache_dtype!r}")
        for name, v in (("batch_size", batch_size), ("max_length", max_length),
                        ("block_size", block_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if calibration is not None and len(calibration) != self.num_layers:
            raise ValueError(f"calibration: expected one (m, lam) per layer ({self.num_layers}), "
                             f"got {len(calibration)}")
        self.key_format = KEY_FORMATS[kv_cache_dtype]
        self.rows, self.max_length, self.block_size = batch_size, max_length, block_size
        self.engine = EngineLayers(self.head_dim, self.num_kv_heads, self.key_format,
                                   calibration, sink_entries)
        device = torch.device(device) if device is not None else next(model.parameters()).device
        per_seq = math.ceil(max_length / block_size)
        num_blocks = batch_size * per_seq
        c = bytes_per_token_head(self.head_dim, self.key_format)
        self.buffers = [torch.zeros(num_blocks, self.num_kv_heads, block_size, c,
                                    dtype=torch.uint8, device=device)
                        for _ in range(self.num_layers)]  # uint8 [blocks, Hkv, bs, C] per layer
        self.block_table = torch.arange(num_blocks, dtype=torch.int32,
                                        device=device).view(batch_size, per_seq)
        self.lens = torch.zeros(batch_size, dtype=torch.long, device=device)  # written per row
        self._updated: Optional[int] = None
        self._step: Optional[tuple] = None
        self._static: Optional[StepMetadata] = None  # start_decode's persistent metadata
        self._longest = 0  # the longest row, known on the host
        super().__init__(layers=[_CountingLayer(self, i) for i in range(self.num_layers)])
        attach(model)

    @property
    def nbytes(self) -> int:
        """Bytes of KV memory the cache holds (the format's pages; the shared states aside)."""
        return sum(b.numel() for b in self.buffers)

    def reset(self) -> None:
        super().reset()
        self.lens.zero_()
        self._static, self._longest = None, 0
        self.engine.layers.clear()
        for b in self.buffers:
            b.zero_()

    def start_decode(self) -> None:
        """From now on every forward is one token per row, no padding, planned before it by
        ``advance_decode`` (outside the forward): the forward then computes nothing on the host,
        so a CUDA graph of the decode step can be captured and replayed (the metadata is captured
        with max_seq_len at ``max_length``, as vLLM captures its graphs). ``stop_decode`` ends
        it."""
        dev, rows = self.lens.device, self.rows
        self._static = StepMetadata(
            torch.arange(rows + 1, dtype=torch.int32, device=dev), self.lens.to(torch.int32),
            self.block_table, torch.full((rows,), -1, dtype=torch.long, device=dev),
            torch.zeros(rows, dtype=torch.long, device=dev), rows, self.max_length)

    def advance_decode(self) -> None:
        """The next decode step's positions, slots and lengths, in place (no host sync)."""
        m = self._static
        if m is None:
            raise ValueError("advance_decode: call start_decode first")
        self._longest += 1
        if self._longest > self.max_length:
            raise ValueError(f"max_length: a row reaches {self._longest} tokens, the cache "
                             f"holds {self.max_length}")
        bs = self.block_size
        m.positions.copy_(self.lens)
        m.slot_mapping.copy_(self.block_table.gather(1, (self.lens // bs)[:, None])[:, 0].long()
                             * bs + self.lens % bs)
        self.lens.add_(1)
        m.seq_lens.copy_(self.lens)

    def stop_decode(self) -> None:
        self._static = None

    def _plan(self, mask: Optional[torch.Tensor], batch: int, q_len: int,
              device) -> tuple:
        """The step: which of the batch x q_len tokens are real (the padding mask's last q_len
        columns), their positions in their rows, slots and the call's metadata."""
        if batch != self.rows:
            raise ValueError(f"batch_size: the cache holds {self.rows} rows, the input has "
                             f"{batch}")
        real = (mask[:, -q_len:] if mask is not None else
                torch.ones(batch, q_len, dtype=torch.bool, device=device))
        counts = real.sum(1)
        after = self.lens + counts
        longest = int(after.max())
        if longest > self.max_length:
            raise ValueError(f"max_length: a row reaches {longest} tokens, the cache holds "
                             f"{self.max_length}")
        pos = self.lens[:, None] + real.long().cumsum(1) - 1  # [batch, q_len]
        idx = real.flatten().nonzero().squeeze(1)
        rows = idx // q_len
        pos = pos.flatten()[idx]
        slots = self.block_table[rows, pos // self.block_size].long() * self.block_size + \
            pos % self.block_size
        cu = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        cu[1:] = counts.cumsum(0)
        meta = StepMetadata.build(cu, after.to(torch.int32), self.block_table, slots, idx.numel(),
                                  longest, positions=pos)
        self.lens.copy_(after)
        self._longest = longest
        return meta, idx


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
              dropout: float = 0.0, sliding_window: Optional[int] = None,
              softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function "turboquant": query [batch, Hq, q_len, D], key and value
    [batch, Hkv, q_len, D] (this step's, as the cache's update returned them), attention_mask
    ``padding_mask``'s -> output [batch, q_len, Hq, D]."""
    cache = _ACTIVE.get()
    layer_idx = module.layer_idx
    if not isinstance(cache, PagedKVCache) or cache._updated != layer_idx:
        raise ValueError("past_key_values: the 'turboquant' attention reads a turboquant "
                         "PagedKVCache; pass one to generate/forward (past_key_values=)")
    batch, num_heads, q_len, d = query.shape
    if cache._static is not None:  # start_decode: planned before the forward
        if q_len != 1 or batch != cache.rows:
            raise ValueError(f"query: start_decode expects one token for each of the "
                             f"{cache.rows} rows, got {batch} x {q_len}")
        meta, idx = cache._static, None
    else:
        if layer_idx == 0:
            cache._step = cache._plan(attention_mask, batch, q_len, query.device)
        meta, idx = cache._step
    return cache.engine.run(layer_idx, query, key, value, cache.buffers[layer_idx], meta, idx,
                            scaling, sliding_window, softcap, s_aux), None


def attach(model) -> None:
    """Register "turboquant" with transformers and make it the model's attention."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, padding_mask)
    model.set_attn_implementation(NAME)
