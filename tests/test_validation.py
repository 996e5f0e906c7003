"""Every bad argument raises a TypeError/ValueError that names it."""
import pytest
import torch

import turboquant as tq
from turboquant.cache import build_paged_problem
from turboquant.config import PER_SEQUENCE, PLAIN
from turboquant.smoothing import allocate_state


@pytest.fixture
def case():
    gen = torch.Generator().manual_seed(0)
    prob = build_paged_problem([20, 7, 33], 2, 64, 16, generator=gen)
    query = torch.randn(3, 4, 64, generator=gen).bfloat16()
    kc, vc, ks, vs = prob.cache
    return dict(query=query, key_cache=kc, value_cache=vc, key_scales=ks, value_scales=vs,
                block_tables=prob.block_tables, seq_lens=prob.seq_lens, scale=0.125,
                **prob.kwargs)


def call(case, **changes):
    args = dict(case)
    kwargs = {k: args.pop(k) for k in list(args) if k in (
        "cu_query_lens", "out", "sliding_window", "logits_soft_cap", "backend", "max_seq_len",
        "config", "seq_state", "state_ids", "shared_state")}
    args.update({k: v for k, v in changes.items() if k in args})
    kwargs.update({k: v for k, v in changes.items() if k not in args})
    return tq.paged_attention_fp4(*args.values(), **kwargs)


BAD = [
    (dict(query=torch.randn(3, 4, 64)), TypeError, "query.*bfloat16.*float32"),
    (dict(query=torch.randn(3, 4, 64, 1).bfloat16()), ValueError, "query.*3-D"),
    (dict(query=torch.randn(3, 3, 64).bfloat16()), ValueError, "query.*divisible"),
    (dict(query=torch.randn(4, 4, 64).bfloat16()), ValueError, "query.*one token per sequence"),
    (dict(query=torch.randn(3, 4, 128).bfloat16()), ValueError, "key_cache.*head dim 128"),
    (dict(key_cache=torch.zeros(5, 2, 16, 32, dtype=torch.int8)), TypeError, "key_cache.*uint8"),
    (dict(value_cache=torch.zeros(5, 2, 16, 31, dtype=torch.uint8)), ValueError, "value_cache"),
    (dict(key_scales=torch.zeros(5, 2, 16, dtype=torch.uint8)), ValueError, "key_scales.*shape"),
    (dict(value_scales=torch.zeros(5, 16, 2, 2, dtype=torch.uint8)), ValueError, "value_scales"),
    (dict(block_tables=torch.zeros(3, 3, dtype=torch.int64)), TypeError, "block_tables.*int32"),
    (dict(block_tables=torch.zeros(2, 3, dtype=torch.int32)), ValueError, "block_tables.*rows"),
    (dict(seq_lens=torch.tensor([20, 7, 33], dtype=torch.int64)), TypeError, "seq_lens"),
    (dict(seq_lens=torch.tensor([20, 7, 999], dtype=torch.int32)), ValueError, "seq_lens.*999"),
    (dict(seq_lens=torch.tensor([20, -1, 3], dtype=torch.int32)), ValueError, "seq_lens"),
    (dict(scale="x"), TypeError, "scale"),
    (dict(sliding_window=-1), ValueError, "sliding_window"),
    (dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap"),
    (dict(max_seq_len=10), ValueError, "seq_lens.*10"),
    (dict(max_seq_len=10_000), ValueError, "max_seq_len"),
    (dict(out=torch.empty(3, 4, 64)), TypeError, "out.*bfloat16"),
    (dict(out=torch.empty(3, 4, 32).bfloat16()), ValueError, "out.*shape"),
    (dict(backend="nope"), ValueError, "backend.*nope"),
    (dict(cu_query_lens=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, "cu_query_lens"),
    (dict(cu_query_lens=torch.tensor([0, 2, 1, 3], dtype=torch.int32)), ValueError,
     "cu_query_lens.*non-decreasing"),
    (dict(cu_query_lens=torch.tensor([0, 1, 2, 4], dtype=torch.int32)), ValueError,
     "cu_query_lens.*end at"),
    (dict(cu_query_lens=torch.tensor([0, 1, 2, 3], dtype=torch.int64)), TypeError,
     "cu_query_lens.*int32"),
    (dict(shared_state=None), ValueError,
     r"shared_state: config 'default'.*allocate_shared_state\(2, 64, num_blocks\)"),
    (dict(seq_state=torch.zeros(3, 2, 5, 64)), ValueError, "shared_state: given with seq_state"),
    (dict(config=tq.QuantConfig(key_smoothing=None, sink=False)), ValueError,
     "config: this cache was written with config 'default'.*passes 'rotation'"),
    (dict(workspace=torch.zeros(64, dtype=torch.int8)), TypeError, "workspace.*uint8"),
    (dict(workspace=torch.zeros(4, 16, dtype=torch.uint8)), ValueError, "workspace.*1-D"),
    (dict(workspace=torch.zeros(64, dtype=torch.uint8)[1:]), ValueError,
     "workspace.*16-byte aligned"),
    (dict(workspace=torch.zeros(64, dtype=torch.uint8)[::2]), ValueError,
     "workspace.*contiguous"),
]


# the per-sequence record (the option): its own arguments
BAD_SEQ = [
    (dict(seq_state=None), ValueError,
     "seq_state: config 'rotation[+]smooth[+]sink'.*allocate_state"),
    (dict(state_ids=None), ValueError, "seq_state: config 'rotation[+]smooth[+]sink'"),
    (dict(state_ids=torch.zeros(3, dtype=torch.int32),
          seq_state=torch.zeros(3, 2, 4, 64, dtype=torch.float16)), TypeError,
     "seq_state.*float32"),
    (dict(state_ids=torch.zeros(3, dtype=torch.int32),
          seq_state=torch.zeros(3, 2, 3, 64)), ValueError, "seq_state.*shape"),
    (dict(seq_state=torch.zeros(3, 2, 5, 64),
          state_ids=torch.tensor([0, 1, 2])), TypeError, "state_ids.*int32"),
    (dict(seq_state=torch.zeros(3, 2, 5, 64),
          state_ids=torch.tensor([0, 1], dtype=torch.int32)), ValueError, "state_ids.*shape"),
    (dict(seq_state=torch.zeros(3, 2, 5, 64),
          state_ids=torch.tensor([0, 1, 3], dtype=torch.int32)), ValueError,
     r"state_ids.*\[0, 3\).*max 3"),
]


@pytest.fixture
def case_seq():
    gen = torch.Generator().manual_seed(0)
    prob = build_paged_problem([20, 7, 33], 2, 64, 16, generator=gen, config=PER_SEQUENCE)
    query = torch.randn(3, 4, 64, generator=gen).bfloat16()
    kc, vc, ks, vs = prob.cache
    return dict(query=query, key_cache=kc, value_cache=vc, key_scales=ks, value_scales=vs,
                block_tables=prob.block_tables, seq_lens=prob.seq_lens, scale=0.125,
                **prob.kwargs)


@pytest.mark.parametrize("changes,exc,match", BAD_SEQ)
def test_bad_per_sequence_state_arguments(case_seq, changes, exc, match):
    with pytest.raises(exc, match=match):
        call(case_seq, **changes)


@pytest.mark.parametrize("changes,exc,match", BAD)
def test_bad_attention_arguments(case, changes, exc, match):
    with pytest.raises(exc, match=match):
        call(case, **changes)


def test_block_id_out_of_range(case):
    tables = case["block_tables"].clone()
    tables[1, 0] = case["key_cache"].shape[0]
    with pytest.raises(ValueError, match="block_tables.*block ids in \\[0, "):
        call(case, block_tables=tables)
    tables[1, 0] = -1
    with pytest.raises(ValueError, match="block_tables.*-1"):
        call(case, block_tables=tables)


def test_more_query_tokens_than_keys(case):
    q = torch.randn(40, 4, 64).bfloat16()
    cu = torch.tensor([0, 30, 31, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_query_lens.*sequence 0 has 30"):
        call(case, query=q, cu_query_lens=cu)


def test_device_mismatch_named(case):
    meta = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="seq_lens.*meta"):
        call(case, seq_lens=meta)


def test_value_checks_can_be_switched_off(case):
    seq = torch.tensor([20, 7, 999], dtype=torch.int32)
    with tq.value_checks(False):
        from turboquant.calls import make_attention_call
        make_attention_call(*[case[k] for k in ("query", "key_cache", "value_cache",
                                                "key_scales", "value_scales", "block_tables")],
                            seq, 0.125)
    with pytest.raises(ValueError, match="seq_lens"):
        call(case, seq_lens=seq)


def test_empty_batch_returns_empty(case):
    kc = case["key_cache"]
    out = tq.paged_attention_fp4(torch.zeros(0, 4, 64).bfloat16(), kc, case["value_cache"],
                                 case["key_scales"], case["value_scales"],
                                 torch.zeros(0, 3, dtype=torch.int32),
                                 torch.zeros(0, dtype=torch.int32), 0.125,
                                 shared_state=case["shared_state"])
    assert out.shape == (0, 4, 64)


@pytest.fixture
def never_backend(monkeypatch):
    """A backend of the highest priority that declines every attention call."""
    from turboquant import registry

    class Never(registry.Backend):
        name, priority = "never", 1000

        def check_attention(self, call):
            return "head dim 64 is not supported"

    monkeypatch.setitem(registry._BACKENDS, "never", Never())


def test_named_backend_that_cannot_run_says_why(case, never_backend):
    with pytest.raises(ValueError, match="backend='never' cannot run.*head dim 64"):
        call(case, backend="never")
    call(case)  # auto skips it and falls back to the reference
    names = [row["name"] for row in tq.backends()]
    assert names[0] == "never" and "reference" in names


CACHE_BAD = [
    (dict(key=torch.randn(4, 2, 64).int()), TypeError, "key"),
    (dict(value=torch.randn(4, 2, 64).half()), TypeError, "value.*float32"),
    (dict(value=torch.randn(4, 2, 32)), ValueError, "value.*shape"),
    (dict(key_cache=torch.zeros(6, 3, 16, 32, dtype=torch.uint8)), ValueError, "key_cache.*kv heads"),
    (dict(key_cache=torch.zeros(6, 2, 12, 32, dtype=torch.uint8)), ValueError, "key_cache.*power-of-two"),
    (dict(slot_mapping=torch.tensor([0, 1, 2, 96])), ValueError, "slot_mapping.*96"),
    (dict(slot_mapping=torch.tensor([0, 1, 2, -2])), ValueError, "slot_mapping.*-2"),
    (dict(slot_mapping=torch.tensor([0.0, 1, 2, 3])), TypeError, "slot_mapping.*int64"),
    (dict(slot_mapping=torch.tensor([0, 1, 2])), ValueError, "slot_mapping.*shape"),
    (dict(seq_state=None), ValueError, "seq_state: config 'rotation[+]smooth[+]sink'"),
    (dict(seq_state=None, state_ids=None, config=tq.QuantConfig()), ValueError,
     "shared_state: config 'default'"),
    (dict(state_ids=torch.tensor([0, 0, 0, 2], dtype=torch.int32)), ValueError,
     r"state_ids.*\[0, 2\).*max 2"),
    (dict(positions=torch.tensor([0, 1, 2])), ValueError, "positions.*shape"),
    (dict(positions=torch.tensor([0.0, 1, 2, 3])), TypeError, "positions.*int"),
    (dict(calibration=(torch.zeros(2, 64), torch.ones(2, 64))), ValueError,
     "calibration: config 'rotation[+]smooth[+]sink' does not use a calibration file"),
    (dict(config=tq.QuantConfig(key_smoothing="calibrated")), ValueError,
     "calibration: key_smoothing='calibrated' with seq_state needs"),
    (dict(config=tq.QuantConfig(key_smoothing="calibrated"),
          calibration=(torch.zeros(2, 64), torch.ones(2, 32))), ValueError,
     r"calibration: key_scale: expected shape \[num_kv_heads, D\] = \(2, 64\)"),
    (dict(config=tq.QuantConfig(key_smoothing="calibrated"),
          calibration=(torch.zeros(2, 64), torch.ones(2, 64).double())), TypeError,
     "calibration: key_scale: expected dtype torch.float32"),
    (dict(config=tq.QuantConfig(key_smoothing="calibrated"),
          calibration=(torch.zeros(2, 64), torch.zeros(2, 64))), ValueError,
     "calibration: key_scale: expected values > 0"),
    (dict(config=tq.QuantConfig(key_smoothing="calibrated"),
          calibration=(torch.full((2, 64), float("inf")), torch.ones(2, 64))), ValueError,
     "calibration: key_center: expected finite values"),
]


@pytest.mark.parametrize("changes,exc,match", CACHE_BAD)
def test_bad_cache_write_arguments(changes, exc, match):
    cache = tq.allocate_cache(6, 2, 16, 64)
    args = dict(key=torch.randn(4, 2, 64), value=torch.randn(4, 2, 64),
                key_cache=cache.key_cache, value_cache=cache.value_cache,
                key_scales=cache.key_scales, value_scales=cache.value_scales,
                slot_mapping=torch.tensor([0, 1, 2, 3]), seq_state=allocate_state(2, 2, 64),
                state_ids=torch.zeros(4, dtype=torch.int32), positions=torch.arange(4),
                config=PER_SEQUENCE)
    args.update(changes)
    with pytest.raises(exc, match=match):
        tq.reshape_and_cache_fp4(**args)


def test_state_given_to_a_config_without_state():
    gen = torch.Generator().manual_seed(0)
    prob = build_paged_problem([20], 2, 64, 16, generator=gen, config=PLAIN)
    with pytest.raises(ValueError, match="seq_state: config 'plain' keeps no per-sequence state"):
        tq.paged_attention_fp4(torch.zeros(1, 4, 64).bfloat16(), *prob.cache, prob.block_tables,
                               prob.seq_lens, 0.1, config=PLAIN, seq_state=allocate_state(1, 2, 64),
                               state_ids=torch.zeros(1, dtype=torch.int32))


def test_a_cache_is_read_with_the_config_it_was_written_with():
    """The first write binds its config to the cache: a read without config uses it, a read or
    write with another config raises (issue 14: a rotated cache read without config gave
    cosine -0.03, silently)."""
    from turboquant.api import _CACHE_CONFIGS, cache_config

    gen = torch.Generator().manual_seed(1)
    rot = tq.QuantConfig.parse("rotation")
    cache = tq.allocate_cache(4, 2, 16, 64)
    k = torch.randn(40, 2, 64, generator=gen)
    assert cache_config(cache.key_cache) is None
    tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(40), config=rot)
    assert cache_config(cache.key_cache) == rot
    q = torch.randn(1, 4, 64, generator=gen).bfloat16()
    args = (q, *cache, torch.arange(4, dtype=torch.int32)[None], torch.tensor([40], dtype=torch.int32), 0.125)
    assert torch.equal(tq.paged_attention_fp4(*args), tq.paged_attention_fp4(*args, config=rot))
    with pytest.raises(ValueError, match="config: this cache was written with config 'rotation'"):
        tq.paged_attention_fp4(*args, config=PLAIN)
    with pytest.raises(ValueError, match="config: this cache was written with config 'rotation'"):
        tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(40), config=PLAIN)
    # a rejected first write binds nothing
    other = tq.allocate_cache(4, 2, 16, 64)
    with pytest.raises(ValueError, match="positions"):
        tq.reshape_and_cache_fp4(k, k, *other, torch.arange(40), config=PLAIN,
                                 positions=torch.arange(40))
    assert cache_config(other.key_cache) is None
    # the binding lives as long as the cache
    key = _CACHE_CONFIGS.key(cache.key_cache)
    assert key in _CACHE_CONFIGS._facts
    del cache, args, other
    import gc

    gc.collect()
    assert key not in _CACHE_CONFIGS._facts


def test_bad_block_ids_give_nan_with_checks_off(case):
    """Issue 14: with value checks off the reference read block 15 for an id of -1 (Python
    wrap-around) and raised IndexError for 999; every backend now gives NaN for exactly that
    sequence (and never reads out of bounds)."""
    kw = {k: case[k] for k in ("config", "shared_state")}
    args = [case[k] for k in ("query", "key_cache", "value_cache", "key_scales", "value_scales")]
    for bad in (-1, 999):
        tables = case["block_tables"].clone()
        tables[1, 0] = bad
        with tq.value_checks(False):
            out = tq.paged_attention_fp4(*args, tables, case["seq_lens"], 0.125, **kw)
        assert torch.isnan(out[1]).all(), bad
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    # a seq_len past what the block table holds
    lens = case["seq_lens"].clone()
    lens[2] = 100
    with tq.value_checks(False):
        out = tq.paged_attention_fp4(*args, case["block_tables"], lens, 0.125, **kw)
    assert torch.isnan(out[2]).all() and torch.isfinite(out[:2]).all()


def test_writer_skips_slots_past_the_cache_with_checks_off():
    """Issue 14: a slot past the cache raised IndexError after some bytes were written; now it
    is skipped like -1 (the cuda writer does the same), and the valid tokens are written."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(4, 2, 64, generator=gen)
    slots = torch.tensor([0, 5, 100000, 7])
    a, b = tq.allocate_cache(6, 2, 16, 64, fill=0xAB), tq.allocate_cache(6, 2, 16, 64, fill=0xAB)
    with tq.value_checks(False):
        tq.reshape_and_cache_fp4(k, k, *a, slots, config=PLAIN)
    tq.reshape_and_cache_fp4(k, k, *b, torch.tensor([0, 5, -1, 7]), config=PLAIN)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_a_rejected_write_leaves_the_cache_unchanged():
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(4, 2, 64, generator=gen)
    cache = tq.allocate_cache(6, 2, 16, 64, fill=0xAB)
    before = [t.clone() for t in cache]
    with pytest.raises(ValueError, match="slot_mapping"):
        tq.reshape_and_cache_fp4(k, k, *cache, torch.tensor([0, 5, 100000, 7]), config=PLAIN)
    for x, y in zip(cache, before):
        assert torch.equal(x, y)


def test_allocate_cache_rejects_odd_head_dims_and_bad_groups():
    with pytest.raises(ValueError, match="head_dim: expected an even head dim"):
        tq.allocate_cache(4, 2, 16, 95)
    with pytest.raises(ValueError, match="scale_group: per-32 scales need a head dim divisible"):
        tq.allocate_cache(4, 2, 16, 48, scale_group=32)


def test_explain_says_which_backend_runs_and_why_the_others_decline(case, never_backend):
    args = [case[k] for k in ("query", "key_cache", "value_cache", "key_scales", "value_scales",
                              "block_tables", "seq_lens", "scale")]
    kw = {k: case[k] for k in ("config", "shared_state")}
    rows = tq.explain(*args, **kw)
    assert rows[0] == {"name": "never", "reason": "head dim 64 is not supported", "chosen": False}
    chosen = [r["name"] for r in rows if r["chosen"]]
    assert chosen == ["reference"]  # a CPU machine: the vendor backends say why they can't
    assert all(r["reason"] for r in rows if not r["chosen"] and r["name"] != "reference")


def test_auto_warns_once_when_the_reference_runs_off_the_cpu(monkeypatch):
    """Issue 14: auto fell back to the reference on GPU tensors without a word (2.65 ms per
    call where the kernel takes 7 us). Meta tensors stand in for a device here."""
    import warnings

    from turboquant import registry
    from turboquant.calls import make_attention_call

    monkeypatch.setattr(registry, "_warned", set())
    meta = dict(device="meta")
    call = make_attention_call(torch.empty(2, 4, 64, dtype=torch.bfloat16, **meta),
                               torch.empty(4, 2, 16, 32, dtype=torch.uint8, **meta),
                               torch.empty(4, 2, 16, 32, dtype=torch.uint8, **meta),
                               torch.empty(4, 16, 2, dtype=torch.uint8, **meta),
                               torch.empty(4, 16, 2, dtype=torch.uint8, **meta),
                               torch.empty(2, 2, dtype=torch.int32, **meta),
                               torch.empty(2, dtype=torch.int32, **meta), 0.1, check_values=False)
    with pytest.warns(RuntimeWarning, match="runs the attention on the reference backend.*meta.*cuda: "):
        assert registry.select("auto", "attention", call).name == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reasons: no second warning
        assert registry.select("auto", "attention", call).name == "reference"


def test_rejected_write_binds_nothing_and_hints():
    """Head dim 96 with the default config (rotation needs a power of two): refused with the
    way out in the message, the cache left unbound, and the retry without rotation accepted."""
    cache = tq.allocate_cache(2, 1, 16, 96)
    k = torch.randn(3, 1, 96, dtype=torch.bfloat16)
    state = tq.allocate_shared_state(1, 96, 2)
    with pytest.raises(ValueError, match=r"head_dim: .*power of two.*rotation=False"):
        tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(3), shared_state=state,
                                 positions=torch.arange(3))
    assert tq.api.cache_config(cache.key_cache) is None
    tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(3), config=tq.QuantConfig(rotation=False),
                             shared_state=state, positions=torch.arange(3))


def test_config_mismatch_names_what_differs():
    cache = tq.allocate_cache(2, 1, 16, 64)
    k = torch.randn(3, 1, 64, dtype=torch.bfloat16)
    rot = tq.QuantConfig.parse("rotation")
    tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(3), config=rot)
    other = tq.QuantConfig(rotation=True, rotation_seed=7, key_smoothing=None, sink=False)
    with pytest.raises(ValueError, match=r"differs in rotation_seed 0 \(written\) vs 7"):
        tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(3), config=other)


def test_first_write_without_positions_is_refused():
    """The per-sequence record is filled by the write that holds position 0 with positions=; a
    write into a slot never filled (positions forgotten) raises, naming it, instead of leaving a
    record of NaN that every later read returns."""
    cache = tq.allocate_cache(2, 1, 16, 64)
    k = torch.randn(3, 1, 64, dtype=torch.bfloat16)
    state = tq.allocate_state(2, 1, 64)
    with pytest.raises(ValueError, match="positions: slot 1 has no record yet"):
        tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(3), seq_state=state,
                                 state_ids=torch.ones(3, dtype=torch.int32), config=PER_SEQUENCE)
    assert bool(torch.isnan(state).all())  # nothing written


def test_a_copied_cache_is_not_read_without_its_config():
    """A copy of a cache (.clone(), saved and loaded) carries no binding: a read without
    config raises (the API does not guess the config its bytes hold); with the config it was
    written with, the copy reads as the original."""
    cache = tq.allocate_cache(4, 2, 16, 64)
    state = tq.allocate_shared_state(2, 64, 4)
    k = torch.randn(40, 2, 64, dtype=torch.bfloat16)
    tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(40), shared_state=state,
                             positions=torch.arange(40))
    q = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    table, lens = torch.arange(4, dtype=torch.int32)[None], torch.tensor([40], dtype=torch.int32)
    copy = tq.FP4Cache(*(t.clone() for t in cache))
    with pytest.raises(ValueError, match="config: this cache was not written through turboquant"):
        tq.paged_attention_fp4(q, *copy, table, lens, 0.125, shared_state=state)
    want = tq.paged_attention_fp4(q, *cache, table, lens, 0.125, shared_state=state)
    got = tq.paged_attention_fp4(q, *copy, table, lens, 0.125, shared_state=state,
                                 config=tq.QuantConfig())
    assert torch.equal(got, want)


def test_another_layers_shared_state_is_refused():
    """A cache read (or written) with another shared state than its writes used raises, naming
    shared_state: the other state's smoothing and sinks would give wrong numbers silently."""
    cache = tq.allocate_cache(4, 2, 16, 64)
    mine, other = tq.allocate_shared_state(2, 64, 4), tq.allocate_shared_state(2, 64, 4)
    k = torch.randn(40, 2, 64, dtype=torch.bfloat16)
    tq.reshape_and_cache_fp4(k, k, *cache, torch.arange(40), shared_state=mine,
                             positions=torch.arange(40))
    q = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    table, lens = torch.arange(4, dtype=torch.int32)[None], torch.tensor([40], dtype=torch.int32)
    with pytest.raises(ValueError, match="shared_state: this cache was written with another"):
        tq.paged_attention_fp4(q, *cache, table, lens, 0.125, shared_state=other)
    with pytest.raises(ValueError, match="shared_state: this cache was written with another"):
        tq.reshape_and_cache_fp4(k[:1], k[:1], *cache, torch.tensor([40]), shared_state=other)
    assert torch.isfinite(tq.paged_attention_fp4(q, *cache, table, lens, 0.125,
                                                 shared_state=mine)).all()


def test_a_workspace_changes_no_output_and_sizes_to_zero_where_nothing_takes_it(case):
    """A caller's workspace (any size; here poisoned) gives the same bits as none, also through
    num_decodes' two calls; prefill_workspace_bytes is 0 where no backend takes one (the CPU)
    and names its bad arguments."""
    ws = torch.full((4096,), 0xFF, dtype=torch.uint8)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    for kw in (dict(), dict(cu_query_lens=cu), dict(cu_query_lens=cu, num_decodes=2)):
        assert torch.equal(call(case, workspace=ws, **kw), call(case, **kw))
    assert tq.prefill_workspace_bytes(1, 65536, 8, 128, device="cpu") == 0
    assert tq.prefill_workspace_bytes(1, 65536, 8, 96) == 0  # no kernel of that head dim
    for bad, match in ((dict(num_seqs=-1), "num_seqs"), (dict(max_seq_len=1.5), "max_seq_len"),
                       (dict(num_kv_heads=0), "num_kv_heads"), (dict(key_format="fp8"),
                                                                "key_format")):
        args = dict(num_seqs=1, max_seq_len=16, num_kv_heads=8, head_dim=128)
        args.update(bad)
        with pytest.raises(ValueError, match=match):
            tq.prefill_workspace_bytes(**args)
