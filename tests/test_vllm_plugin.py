"""The vLLM plugin (``turboquant.integration.vllm``) against vLLM's own classes, on the CPU: the
entry point vLLM loads, the registered cache dtypes and backends, the page size vLLM computes
from ``customize_spec`` against its BF16 and FP8 pages, vLLM's allocation of the layers' views,
its metadata through our builder, the layer's forward against the API, and what is declined
through vLLM's validation. No vLLM server runs here (nor on the GPU machines: its wheel is over
what a device call carries)."""
import importlib.metadata
import itertools
import math

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backend", reason="vLLM is not installed (.ci/install)")

import turboquant as tq  # noqa: E402
from test_engine_layer import BS, D, HKV, HQ, NB, schedule, slots_of  # noqa: E402
from vllm.config.cache import KV_CACHE_DTYPES, get_kv_cache_dtype_handler  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor,  # noqa: E402
                                        KVQuantMode, create_kv_cache_views, get_kv_quant_mode)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402


@pytest.fixture(scope="module")
def backends():
    """The plugin loaded as vLLM loads it: through its entry point."""
    (ep,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
             if e.name == "turboquant"]
    assert ep.value == "turboquant.integration.vllm:register"
    ep.load()()
    ep.load()()  # idempotent
    return {name: AttentionBackendEnum[name].get_class() for name in ("TQ_FP4", "TQ_K8V4")}


def spec_for(cache_dtype, head_size=D, num_kv_heads=HKV, block_size=BS, backend=None):
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    dtype = STR_DTYPE_TO_TORCH_DTYPE[cache_dtype] if cache_dtype != "auto" else torch.bfloat16
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype,
                             kv_quant_mode=get_kv_quant_mode(cache_dtype))
    return backend.customize_spec(spec) if backend is not None else spec


def test_dtypes_and_backends_are_registered(backends):
    for name in ("tq_fp4", "tq_k8v4"):
        assert name in KV_CACHE_DTYPES
        handler = get_kv_cache_dtype_handler(name)
        assert handler.torch_dtype() == torch.uint8
        assert handler.quant_mode() == KVQuantMode.CUSTOM
    assert backends["TQ_FP4"].get_name() == "TQ_FP4"
    assert backends["TQ_K8V4"].get_name() == "TQ_K8V4"
    assert backends["TQ_FP4"].supports_kv_cache_dtype("tq_fp4")
    assert not backends["TQ_FP4"].supports_kv_cache_dtype("tq_k8v4")
    assert not backends["TQ_FP4"].supports_kv_cache_dtype("fp8")


def test_readme_recipe_names_what_the_plugin_registers(backends):
    """README's `vllm serve` lines: each pairs a registered cache dtype with the backend that
    takes it (the CPU part of the recipe; the server itself does not run here)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    pairs = re.findall(r"^vllm serve MODEL --kv-cache-dtype (\S+) --attention-backend (\S+)",
                       readme, flags=re.M)
    assert sorted(pairs) == [("tq_fp4", "TQ_FP4"), ("tq_k8v4", "TQ_K8V4")]
    for dtype, name in pairs:
        assert dtype in KV_CACHE_DTYPES and backends[name].supports_kv_cache_dtype(dtype)


@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_pages_and_capacity_against_vllm_bf16_and_fp8(backends, head_size):
    """vLLM's page bytes for our dtypes (what its block count divides memory by), against its
    own BF16 and FP8 specs of the same layer: the capacity at a fixed budget."""
    hkv, bs = 8, 16
    bf16 = spec_for("auto", head_size, hkv, bs).page_size_bytes
    fp8 = spec_for("fp8", head_size, hkv, bs).page_size_bytes
    fp4 = spec_for("tq_fp4", head_size, hkv, bs, backends["TQ_FP4"]).page_size_bytes
    k8v4 = spec_for("tq_k8v4", head_size, hkv, bs, backends["TQ_K8V4"]).page_size_bytes
    assert (bf16, fp8) == (bs * hkv * 4 * head_size, bs * hkv * 2 * head_size)
    assert fp4 == bs * tq.cache.kv_bytes_per_token(hkv, head_size)
    assert k8v4 == bs * tq.cache.kv_bytes_per_token(hkv, head_size, key_format="fp8_e4m3")
    budget = 8 << 30  # blocks vLLM fits in 8 GiB of KV memory per layer set
    blocks = {k: budget // p for k, p in (("bf16", bf16), ("fp8", fp8), ("fp4", fp4),
                                          ("k8v4", k8v4))}
    assert blocks["fp4"] / blocks["bf16"] == pytest.approx(4 * head_size / (head_size + 2),
                                                          rel=1e-4)
    assert blocks["fp4"] / blocks["fp8"] > 1.9
    assert blocks["k8v4"] / blocks["fp8"] > 1.3


def test_validation_declines_with_vllm_reasons(backends):
    b = backends["TQ_FP4"]
    ok = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="tq_fp4", block_size=16,
              use_mla=False, has_sink=True, use_sparse=False, use_mm_prefix=False,
              use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
              attn_type=AttentionType.DECODER, has_sliding_window=True)
    assert b.validate_configuration(**ok) == []
    assert b.validate_configuration(**dict(ok, device_capability=DeviceCapability(12, 0))) == []
    bad = {"head_size": 96, "dtype": torch.float32, "kv_cache_dtype": "fp8", "block_size": 8,
           "use_mla": True, "device_capability": DeviceCapability(7, 5),
           "attn_type": AttentionType.ENCODER_ONLY}
    for field, value in bad.items():
        assert len(b.validate_configuration(**dict(ok, **{field: value}))) == 1, field
    assert b.validate_configuration(**ok, use_kv_connector=True) == ["KV connector not supported"]
    impl = b.get_impl_cls()
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        impl(HQ, D, 1.0, HKV, alibi_slopes=[1.0] * HQ, kv_cache_dtype="tq_fp4")
    with pytest.raises(NotImplementedError, match="kv_sharing_target_layer_name"):
        impl(HQ, D, 1.0, HKV, kv_cache_dtype="tq_fp4",
             kv_sharing_target_layer_name="model.layers.0.self_attn.attn")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        impl(HQ, D, 1.0, HKV, kv_cache_dtype="fp8")


class _Layer:
    def __init__(self, name):
        self.layer_name = name


@pytest.mark.parametrize("name", ["TQ_FP4", "TQ_K8V4"])
def test_forward_over_vllm_allocated_pages_matches_the_api(backends, name, monkeypatch):
    """Two layers' views from vLLM's allocator (LBNHC, raw bytes poisoned with 0xFF), metadata
    from vLLM's CommonAttentionMetadata through our builder, the steps of
    ``test_engine_layer`` (chunked prefill, decodes, a 4-token verification, padded rows):
    the same outputs, bit for bit, as the API on allocate_cache."""
    monkeypatch.delenv("TURBOQUANT_CALIBRATION", raising=False)
    backend = backends[name]
    dtype = backend.supported_kv_cache_dtypes[0]
    key_format = {"tq_fp4": "fp4", "tq_k8v4": "fp8_e4m3"}[dtype]
    spec = spec_for(dtype, backend=backend)
    page = spec.page_size_bytes
    raw = torch.full((2 * NB * page,), 0xFF, dtype=torch.uint8).view(torch.int8)
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    views = create_kv_cache_views(raw, spec, NB, KVCacheLayout.LBNHC,
                                  KVCacheTensor(size=raw.numel(), layers=names,
                                                layer_stride=NB * page, block_stride=page))
    assert [tuple(v.shape) for v in views] == [(NB, HKV, BS, spec.state_content_bytes)] * 2
    builder = backend.get_builder_cls()(spec, names, None, torch.device("cpu"))
    impls = [backend.get_impl_cls()(HQ, D, D ** -0.5, HKV, kv_cache_dtype=dtype)
             for _ in names]
    gen = torch.Generator().manual_seed(23)
    table, steps, lens = schedule(gen, "cpu")
    caches = [tq.allocate_cache(NB, HKV, BS, D, key_format=key_format) for _ in names]
    states = [tq.allocate_shared_state(HKV, D, NB) for _ in names]
    pad = 2
    for st in steps:
        n = len(st["seq"])
        slots = torch.cat([slots_of(table, st["seq"], st["pos"]), torch.full((pad,), -1)])
        q_lens = st["cu"][1:] - st["cu"][:-1]
        common = CommonAttentionMetadata(
            query_start_loc=st["cu"], query_start_loc_cpu=st["cu"], seq_lens=st["seq_lens"],
            num_reqs=len(st["live"]), num_actual_tokens=n, max_query_len=int(q_lens.max()),
            max_seq_len=int(st["seq_lens"].max()), block_table_tensor=table[st["live"]],
            slot_mapping=slots)
        meta = builder.build(0, common)
        assert meta.positions.tolist() == st["pos"] and meta.num_tokens == n
        # vLLM puts one-token requests first (threshold 1); the builder counts those in front
        assert builder.reorder_batch_threshold == 1
        assert meta.num_decodes == len(list(itertools.takewhile(lambda x: x == 1, q_lens)))
        for i, impl in enumerate(impls):
            q = torch.randn(n + pad, HQ, D, generator=gen).bfloat16()
            k = torch.randn(n + pad, HKV, D, generator=gen).bfloat16()
            v = torch.randn(n + pad, HKV, D, generator=gen).bfloat16()
            out = torch.zeros_like(q)
            impl.forward(_Layer(names[i]), q, k, v, views[i], meta, out)
            tq.reshape_and_cache_fp4(k[:n], v[:n], *caches[i], slots[:n],
                                     positions=meta.positions, shared_state=states[i])
            want = tq.paged_attention_fp4(q[:n], *caches[i], table[st["live"]], st["seq_lens"],
                                          D ** -0.5, cu_query_lens=st["cu"],
                                          shared_state=states[i])
            assert torch.equal(out[:n], want) and torch.isfinite(out[:n]).all()
            assert not out[n:].any()
    # the profiling run (no metadata yet) gives zeros and writes nothing
    out = torch.ones(3, HQ, D, dtype=torch.bfloat16)
    before = raw.clone()
    impls[0].forward(_Layer(names[0]), out.clone(), None, None, views[0], None, out)
    assert not out.any() and torch.equal(raw, before)
    capture = builder.build_for_cudagraph_capture(common)
    assert capture.max_seq_len == table.shape[1] * BS


def test_calibration_file_gives_each_layer_its_smoothing(backends, tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    cal = [(torch.randn(HKV, D, generator=gen), torch.rand(HKV, D, generator=gen) + 0.5)
           for _ in range(3)]
    path = tmp_path / "cal.safetensors"
    tq.save_calibration(path, cal)
    monkeypatch.setenv("TURBOQUANT_CALIBRATION", str(path))
    backend = backends["TQ_FP4"]
    spec = spec_for("tq_fp4", backend=backend)
    buf = torch.zeros(NB, HKV, BS, spec.state_content_bytes, dtype=torch.uint8)
    impl = backend.get_impl_cls()(HQ, D, D ** -0.5, HKV, kv_cache_dtype="tq_fp4")
    lens = torch.tensor([3], dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=cu, query_start_loc_cpu=cu, seq_lens=lens, num_reqs=1,
        num_actual_tokens=3, max_query_len=3, max_seq_len=3,
        block_table_tensor=torch.tensor([[5]], dtype=torch.int32),
        slot_mapping=torch.arange(80, 83))
    meta = backend.get_builder_cls()(spec, ["x"], None, "cpu").build(0, common)
    x = torch.randn(3, HQ, D, generator=gen).bfloat16()
    impl.forward(_Layer("model.layers.2.self_attn.attn"), x, x[:, :HKV], x[:, :HKV], buf, meta,
                 torch.empty_like(x))
    smoothing = impl.layer.state.smoothing[0]
    assert torch.equal(smoothing[:, 0], cal[2][0]) and torch.equal(smoothing[:, 1], cal[2][1])
    impl = backend.get_impl_cls()(HQ, D, D ** -0.5, HKV, kv_cache_dtype="tq_fp4")
    with pytest.raises(ValueError, match="TURBOQUANT_CALIBRATION: .* holds 3 layers"):
        impl.forward(_Layer("model.layers.7.self_attn.attn"), x, x[:, :HKV], x[:, :HKV], buf,
                     meta, torch.empty_like(x))
    assert math.isfinite(float(smoothing[:, 1].min()))


def test_builder_declines_setups_that_move_blocks_as_bytes(backends):
    """What vLLM's validation does not see: setups in which vLLM zeroes or copies a block as a
    byte range (ours spans four regions), refused when the builder starts, with the reason;
    and the positions it derives land in its own persistent buffer."""
    from types import SimpleNamespace as NS

    def config(hybrid=False, skip=(), unit=None, draft_dtype=None):
        return NS(model_config=NS(is_hybrid=hybrid, max_model_len=4096),
                  cache_config=NS(kv_cache_dtype_skip_layers=list(skip), prefix_match_unit=unit,
                                  block_size=BS, cache_dtype="tq_fp4"),
                  speculative_config=None if draft_dtype is None else
                  NS(kv_cache_dtype=draft_dtype),
                  scheduler_config=NS(max_num_batched_tokens=64))

    backend = backends["TQ_FP4"]
    spec = spec_for("tq_fp4", backend=backend)
    builder_cls = backend.get_builder_cls()
    for bad, reason in ((dict(hybrid=True), "hybrid models"),
                        (dict(skip=["model.layers.0"]), "--kv-cache-dtype-skip-layers"),
                        (dict(unit=4), "--prefix-match-unit"),
                        (dict(draft_dtype="auto"), "a draft model with another KV-cache dtype")):
        with pytest.raises(NotImplementedError, match=f"does not support {reason}"):
            builder_cls(spec, ["x"], config(**bad), torch.device("cpu"))
    builder = builder_cls(spec, ["x"], config(unit=BS, draft_dtype="tq_fp4"),
                          torch.device("cpu"))
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    lens = torch.tensor([10, 7], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=cu, query_start_loc_cpu=cu, seq_lens=lens, num_reqs=2,
        num_actual_tokens=4, max_query_len=3, max_seq_len=10,
        block_table_tensor=torch.zeros(2, 1, dtype=torch.int32),
        slot_mapping=torch.arange(4))
    first = builder.build(0, common)
    for name, theirs in (("query_start_loc", cu), ("seq_lens", lens),
                         ("slot_mapping", common.slot_mapping),
                         ("block_table", common.block_table_tensor)):
        assert getattr(first, name).data_ptr() == theirs.data_ptr(), name  # views, no copies
    assert first.positions.tolist() == [7, 8, 9, 6]
    assert builder.workspace is None and first.workspace is None  # (none taken on the CPU)
    assert first.positions.data_ptr() == builder._positions.data_ptr()
    second = builder.build(0, common.replace(seq_lens=lens + 1))
    assert second.positions.data_ptr() == first.positions.data_ptr()
    assert first.positions.tolist() == [8, 9, 10, 7]  # updated in place, as a graph reads it


def test_builder_allocates_one_prefill_workspace_for_every_step(backends, monkeypatch):
    """Where a kernel takes the prefill workspace, the builder allocates it once, sized by
    turboquant.prefill_workspace_bytes for one sequence of max_model_len keys (its head size,
    kv heads and key format), and every step's metadata carries that same tensor to the
    layers' calls."""
    from types import SimpleNamespace as NS
    from turboquant.integration.vllm import backend as vb

    asked = []

    def sized(*args, **kwargs):
        asked.append((args, kwargs))
        return 4096
    monkeypatch.setattr(vb, "prefill_workspace_bytes", sized)
    for name, key_format in (("TQ_FP4", "fp4"), ("TQ_K8V4", "fp8_e4m3")):
        backend = backends[name]
        dtype = backend.supported_kv_cache_dtypes[0]
        config = NS(model_config=NS(is_hybrid=False, max_model_len=32768),
                    cache_config=NS(kv_cache_dtype_skip_layers=[], prefix_match_unit=None,
                                    block_size=BS, cache_dtype=dtype),
                    speculative_config=None, scheduler_config=NS(max_num_batched_tokens=64))
        builder = backend.get_builder_cls()(spec_for(dtype, backend=backend), ["x"], config,
                                            torch.device("cpu"))
        assert asked.pop() == ((1, 32768, HKV, D), dict(key_format=key_format,
                                                        device=torch.device("cpu")))
        ws = builder.workspace
        assert ws.dtype == torch.uint8 and ws.shape == (4096,)
        cu = torch.tensor([0, 3, 4], dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=cu, query_start_loc_cpu=cu,
            seq_lens=torch.tensor([10, 7], dtype=torch.int32), num_reqs=2,
            num_actual_tokens=4, max_query_len=3, max_seq_len=10,
            block_table_tensor=torch.zeros(2, 1, dtype=torch.int32),
            slot_mapping=torch.arange(4))
        for _ in range(2):
            assert builder.build(0, common).workspace is ws
