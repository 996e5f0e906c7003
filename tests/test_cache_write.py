"""reshape_and_cache_fp4 (reference backend): vLLM slot semantics, neighbours untouched."""
import dataclasses

import pytest
import torch

import turboquant as tq
from turboquant.config import PLAIN
from turboquant import format as fmt


def _random_cache(nb, hkv, bs, d, group, gen):
    cache = tq.allocate_cache(nb, hkv, bs, d, scale_group=group)
    for t in cache:
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    return cache


@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_writes_exactly_the_mapped_slots(group, dtype, gen):
    nb, hkv, bs, d, n = 37, 3, 16, 64, 200
    cache = _random_cache(nb, hkv, bs, d, group, gen)
    before = [t.clone() for t in cache]
    key = torch.randn(n, hkv, d, generator=gen).to(dtype)
    value = torch.randn(n, hkv, d, generator=gen).to(dtype) * 7
    slots = torch.randperm(nb * bs, generator=gen)[:n]
    slots[::5] = -1  # every fifth token is skipped
    tq.reshape_and_cache_fp4(key, value, *cache, slots, config=dataclasses.replace(PLAIN, scale_group=group))

    kc, ks = fmt.quantize_fp4(key, group)
    vc, vs = fmt.quantize_fp4(value, group)
    if group is None:
        ks, vs = ks.squeeze(-1), vs.squeeze(-1)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written[s] = True
        b, o = divmod(s, bs)
        assert torch.equal(cache.key_cache[b, :, o], kc[i])
        assert torch.equal(cache.value_cache[b, :, o], vc[i])
        assert torch.equal(cache.key_scales[b, o], ks[i])
        assert torch.equal(cache.value_scales[b, o], vs[i])
    untouched = ~written.view(nb, bs)
    for now, old in zip(cache[:2], before[:2]):
        assert torch.equal(now.transpose(1, 2)[untouched], old.transpose(1, 2)[untouched])
    for now, old in zip(cache[2:], before[2:]):
        assert torch.equal(now[untouched], old[untouched])


def test_int32_slots_and_all_skipped(gen):
    cache = _random_cache(4, 2, 16, 128, None, gen)
    before = [t.clone() for t in cache]
    key = torch.randn(3, 2, 128, generator=gen)
    tq.reshape_and_cache_fp4(key, key, *cache, torch.full((3,), -1, dtype=torch.int32), config=PLAIN)
    assert all(torch.equal(a, b) for a, b in zip(cache, before))
    tq.reshape_and_cache_fp4(key, key, *cache, torch.tensor([63, 0, 17], dtype=torch.int32), config=PLAIN)
    assert torch.equal(cache.key_cache[3, :, 15], fmt.quantize_fp4(key[0])[0])


def test_nan_token_gets_nan_scale(gen):
    cache = tq.allocate_cache(2, 1, 16, 64)
    key = torch.randn(2, 1, 64, generator=gen)
    key[1, 0, 3] = float("nan")
    tq.reshape_and_cache_fp4(key, key.clone(), *cache, torch.tensor([0, 1]), config=PLAIN)
    assert cache.key_scales[0, 1, 0].item() == 255 and cache.key_scales[0, 0, 0].item() != 255


def test_empty_batch_is_a_no_op():
    cache = tq.allocate_cache(2, 1, 16, 64)
    empty = torch.zeros(0, 1, 64)
    tq.reshape_and_cache_fp4(empty, empty, *cache, torch.zeros(0, dtype=torch.int64), config=PLAIN)
    assert all((t == 0).all() for t in cache)
