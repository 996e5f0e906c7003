"""An engine's per-layer KV buffer as the cache (``turboquant.cache_in``): what vLLM allocates for
a layer whose page holds D + 2 bytes per (token, kv head) (``customize_spec``'s
state_content_bytes), four contiguous region views, and the same bytes and outputs as a cache
from ``allocate_cache``."""
import pytest
import torch

import turboquant as tq
from turboquant.cache import kv_bytes_per_token


@pytest.mark.parametrize("key_format", ["fp4", "fp8_e4m3"])
def test_buffer_views_tile_the_buffer_and_match_allocate_cache(key_format):
    nb, hkv, bs, d = 9, 2, 16, 64  # one block spare
    page = hkv * bs * ((d if key_format == "fp8_e4m3" else d // 2) + d // 2 + 2)
    assert page == bs * kv_bytes_per_token(hkv, d, key_format=key_format)
    buf = torch.full((nb, page), 0xAB, dtype=torch.uint8)  # vLLM's [num_blocks, page_bytes]
    views = tq.cache_in(buf, nb, hkv, bs, d, key_format=key_format)
    ref = tq.allocate_cache(nb, hkv, bs, d, key_format=key_format, fill=0xAB)
    base, at = buf.data_ptr(), 0
    for v, r in zip(views, ref):
        assert v.shape == r.shape and v.dtype == r.dtype and v.is_contiguous()
        assert v.data_ptr() == base + at and (v.data_ptr() - base) % 16 == 0
        at += v.numel()
    assert at == buf.numel()  # the regions cover the buffer, none overlaps
    g = torch.Generator().manual_seed(3)
    lens = [37, 1, 54]
    table = torch.full((3, 4), -1, dtype=torch.int32)
    perm = torch.randperm(nb, generator=g).to(torch.int32)
    table[0, :3], table[1, :1], table[2, :4] = perm[:3], perm[3:4], perm[4:8]
    pos = torch.cat([torch.arange(n) for n in lens])
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    slots = table[seq, pos // bs].long() * bs + pos % bs
    k = torch.randn(len(pos), hkv, d, generator=g, dtype=torch.bfloat16)
    v = torch.randn(len(pos), hkv, d, generator=g, dtype=torch.bfloat16)
    q = torch.randn(3, 4 * hkv, d, generator=g, dtype=torch.bfloat16)
    outs = []
    for cache in (views, ref):
        state = tq.allocate_shared_state(hkv, d, nb)
        tq.reshape_and_cache_fp4(k, v, *cache, slots, shared_state=state, positions=pos)
        outs.append(tq.paged_attention_fp4(q, *cache, table, torch.tensor(lens, dtype=torch.int32),
                                           d ** -0.5, shared_state=state))
    for a, b in zip(views, ref):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0]).all()


def test_capacity_against_bf16_and_fp8_pages():
    """Per layer and block: BF16 holds 4 D bytes per (token, kv head), FP8 2 D, FP4 D + 2."""
    for d in (64, 128, 256):
        fp4 = kv_bytes_per_token(8, d)
        assert fp4 == 8 * (d + 2)
        bf16, fp8 = 8 * 4 * d, 8 * 2 * d
        assert bf16 / fp4 == pytest.approx(4 * d / (d + 2)) and fp8 / fp4 > 1.9
    assert round(8 * 4 * 128 / kv_bytes_per_token(8, 128), 2) == 3.94


def test_bad_buffers_are_refused_naming_the_argument():
    nb, hkv, bs, d = 4, 2, 16, 64
    n = nb * bs * kv_bytes_per_token(hkv, d)
    with pytest.raises(ValueError, match=f"buffer: expected {n} bytes"):
        tq.cache_in(torch.zeros(n + 1, dtype=torch.uint8), nb, hkv, bs, d)
    with pytest.raises(ValueError, match="buffer: expected a contiguous uint8"):
        tq.cache_in(torch.zeros(n, dtype=torch.int8), nb, hkv, bs, d)
    with pytest.raises(ValueError, match="buffer: expected a contiguous uint8"):
        tq.cache_in(torch.zeros(2 * n, dtype=torch.uint8)[::2], nb, hkv, bs, d)
    with pytest.raises(ValueError, match="block_size: block_size x num_kv_heads"):
        tq.cache_in(torch.zeros(nb * 1 * kv_bytes_per_token(3, d), dtype=torch.uint8), nb, 3, 1, d)
    with pytest.raises(ValueError, match="key_format"):
        tq.cache_in(torch.zeros(n, dtype=torch.uint8), nb, hkv, bs, d, key_format="fp8")
