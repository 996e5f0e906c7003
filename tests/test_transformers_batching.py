"""transformers' continuous batching (``generate_batch``, transformers 5.23 and 5.17) with the KV
cache in the format (``turboquant.integration.transformers_batching``), on the CPU with a small
random Llama: prompts of 1, 54 and 97 tokens, in chunked prefill, with the block-table decode
path, in steps padded as for CUDA graphs and in forks, give the tokens ``PagedKVCache`` gives
each prompt alone; the cache holds the format's bytes and nothing in BF16. (CI runs this file
under 5.23 and, through tests/test_transformers_versions.py, under 5.17.)"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
if transformers.__version__[:4] not in ("5.17", "5.23"):
    pytest.skip(f"continuous batching is wired for transformers 5.23 and 5.17, found "
                f"{transformers.__version__}", allow_module_level=True)

from test_transformers_integration import LENS, batch, calibration, tiny_llama  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402
from turboquant.integration import transformers_batching as tb  # noqa: E402
from turboquant.integration import transformers_cb_cache as cbc  # noqa: E402
from turboquant.integration.transformers import PagedKVCache  # noqa: E402

NEW = 8


def cb_config(**kw):
    """A ContinuousBatchingConfig with pages of 16 (5.17 names the page ``block_size``)."""
    page = "block_size" if cbc.VERSION == "5.17" else "page_size"
    return transformers.ContinuousBatchingConfig(**{page: 16}, **kw)


def alone(model, ids, cal):
    """Greedy tokens of one prompt through PagedKVCache (model.generate)."""
    cache = PagedKVCache(model, 1, 128, calibration=cal, sink_entries=4096)
    with torch.no_grad():
        out = model.generate(input_ids=ids[None], past_key_values=cache, max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("fast_path,padded", [(0, False), (16, False), (0, True), (16, True)])
def test_generate_batch_gives_each_prompt_its_tokens(fast_path, padded, monkeypatch):
    """The same greedy tokens as each prompt alone through PagedKVCache; at every step the
    metadata's positions are each request's last q positions and its slots those the block
    table gives them; with the fast path on, decode steps come with transformers' block table.
    ``padded``: steps padded as for CUDA graphs (padding tokens, empty sequences)."""
    steps = {"checked": 0, "block_table": 0, "padded": 0}
    if padded:
        runner_init = continuous_api.ModelRunner.__init__

        def padding_runner(self, *args, **kwargs):
            runner_init(self, *args, **kwargs)
            self.pad_inputs = True  # what CUDA graphs turn on (none on the CPU)

        monkeypatch.setattr(continuous_api.ModelRunner, "__init__", padding_runner)

    def checked(module, query, key, value, mask, **kw):
        out = tb_attention(module, query, key, value, mask, **kw)
        if module.layer_idx == 0:
            m = kw["cache"].meta
            cu, page = m.query_start_loc.tolist(), 16
            for i in range(len(cu) - 1):
                n, q = int(m.seq_lens[i]), cu[i + 1] - cu[i]
                pos = m.positions[cu[i]:cu[i + 1]].tolist()
                assert pos == list(range(n - q, n))
                row = m.block_table[i].tolist()
                assert m.slot_mapping[cu[i]:cu[i + 1]].tolist() == [
                    row[p // page] * page + p % page for p in pos]
            steps["checked"] += 1
            steps["block_table"] += kw.get("block_table") is not None
            steps["padded"] += query.shape[2] > cu[-1] or int(m.seq_lens.min()) == 0
        return out

    tb_attention = tb.attention
    monkeypatch.setattr(tb, "attention", checked)
    gen = torch.Generator().manual_seed(4)
    model = tiny_llama()
    cal = calibration(model, gen)
    ids, mask = batch(gen)
    prompts = [ids[i, -n:] for i, n in enumerate(LENS)]
    want = [alone(model, p, cal) for p in prompts]
    model.set_attn_implementation("sdpa")
    config = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0)
    cb = cb_config(num_blocks=40, max_batch_tokens=64)
    out = tb.generate_batch(model, [p.tolist() for p in prompts], calibration=cal,
                            sink_entries=4096, generation_config=config,
                            continuous_batching_config=cb, decode_fast_path_blocks=fast_path)
    got = [o.generated_tokens for o in out.values()]
    assert got == want
    assert steps["checked"] >= NEW and (steps["block_table"] > 0) == bool(fast_path)
    assert (steps["padded"] > 0) == padded


def test_the_cache_holds_the_format_bytes_and_forks_copy_them(monkeypatch):
    """Each layer's cache is a uint8 [blocks, Hkv, 16, D + 2] range, transformers holds no K/V
    of its own (5.23: one uint8 tensor; 5.17: its K/V tensors empty); a fork
    (num_return_sequences, top-1 sampling) copies its blocks and both children give the prompt's
    greedy tokens; a dtype outside the two formats is refused, naming kv_cache_dtype."""
    gen = torch.Generator().manual_seed(4)
    model = tiny_llama()
    cal = calibration(model, gen)
    ids, _ = batch(gen)
    prompt = ids[1, -LENS[1]:]
    want = alone(model, prompt, cal)
    hkv, d = model.config.num_key_value_heads, model.config.head_dim
    seen, copies = [], []
    copy = cbc.copy_blocks
    monkeypatch.setattr(cbc, "copy_blocks", lambda *a: (copies.append(a[3:]), copy(*a))[1])
    attention = tb.attention

    def spy(module, query, key, value, mask, **kw):
        seen.append(kw["cache"])
        return attention(module, query, key, value, mask, **kw)

    monkeypatch.setattr(tb, "attention", spy)
    config = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=True, top_k=1,
                                           eos_token_id=-1, pad_token_id=0,
                                           num_return_sequences=2)
    out = tb.generate_batch(model, [prompt.tolist()], calibration=cal, sink_entries=4096,
                            generation_config=config,
                            continuous_batching_config=cb_config(num_blocks=40,
                                                                 max_batch_tokens=64))
    cache = seen[0]
    for buf in cache.buffers.values():
        assert buf.dtype == torch.uint8 and tuple(buf.shape[1:]) == (hkv, 16, d + 2)
    if cbc.VERSION == "5.17":
        assert all(t.numel() == 0 for t in cache.key_cache + cache.value_cache)
    else:
        assert cache.allocator.cache_tensor.dtype == torch.uint8
    assert copies and all(len(src) == len(dst) > 0 for src, dst in copies)
    assert [o.generated_tokens for o in out.values()] == [want] * len(out) and len(out) >= 1
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        tb.generate_batch(model, [[1, 2]], kv_cache_dtype="fp8")


def test_cpu_offload_is_refused():
    """Offloading copies blocks as byte ranges: refused, also when transformers would size it."""
    for space in (None, 1.0):
        cb = cb_config(num_blocks=40, max_batch_tokens=64, cpu_offload_space=space)
        with pytest.raises(ValueError, match="continuous_batching_config: cpu_offload_space"):
            tb.generate_batch(tiny_llama(), [[1, 2]], continuous_batching_config=cb,
                              max_new_tokens=2)


@pytest.mark.parametrize("graphs", [True, (True, False)])
def test_varlen_graphs_are_refused(graphs):
    """Varlen steps build their block table on the host: only decode steps may be captured."""
    model = tiny_llama()
    cb = cb_config(num_blocks=40, max_batch_tokens=64, use_cuda_graph=graphs)
    with pytest.raises(ValueError, match="continuous_batching_config: use_cuda_graph"):
        tb.generate_batch(model, [[1, 2]], continuous_batching_config=cb, max_new_tokens=2)
