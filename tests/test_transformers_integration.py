"""Generation through transformers with the KV cache in turboquant's format
(``turboquant.integration.transformers``), on the CPU: a small random Llama for the cache's
bookkeeping (left padding with prompts of 1, 54 and 97 tokens, the serving path's decode steps
against one prefill of the same tokens, each row against its prompt alone, the bytes held, bad
input), and README's recipe run as written."""
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turboquant.integration.transformers import NAME, PagedKVCache  # noqa: E402

LENS = [1, 54, 97]


def tiny_llama(vocab=128, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


def calibration(model, gen):
    n, hkv, d = model.config.num_hidden_layers, model.config.num_key_value_heads, 64
    return [(0.1 * torch.randn(hkv, d, generator=gen), torch.rand(hkv, d, generator=gen) + 0.5)
            for _ in range(n)]


def batch(gen, lens=LENS, vocab=128):
    width = max(lens)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, width - n:] = torch.randint(1, vocab, (n,), generator=gen)
        mask[i, width - n:] = 1
    return ids, mask


def stepwise_logits(model, cache, ids, mask, targets):
    """One prefill, then one decode step per target token: logits [rows, 1 + steps, vocab]."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    out = [model(input_ids=ids, attention_mask=mask, position_ids=pos,
                 past_key_values=cache).logits[:, -1]]
    for t in range(targets.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out.append(model(input_ids=targets[:, t:t + 1], attention_mask=mask,
                         position_ids=mask.sum(-1, keepdim=True) - 1,
                         past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("kv_cache_dtype", ["tq_fp4", "tq_k8v4"])
def test_decode_steps_match_one_prefill_and_each_row_alone(kv_cache_dtype):
    """The serving path (prefill, then a decode step per token) gives the logits one prefill of
    the same tokens gives (the cache's bytes are the same; only the calls differ), and each row
    of the padded batch the logits of its prompt run alone (a sink table large enough that no
    two rows share an entry: one that did would read that row's first token from FP4). On the
    CPU only: on a GPU, cuBLAS rounds the model's keys apart between the two ways' GEMM shapes,
    and 1.2 % of the cache's bytes differ (H200), which no exact check survives; the GPU runs
    the decode-step test below (the same shapes eager and replayed)."""
    device = "cpu"
    gen = torch.Generator().manual_seed(1)
    model = tiny_llama().to(device)
    cal = calibration(model, gen)
    ids, mask = (t.to(device) for t in batch(gen))
    steps = torch.randint(1, 128, (len(LENS), 6), generator=gen).to(device)
    tol = 2e-3
    with torch.no_grad():
        cache = PagedKVCache(model, len(LENS), 128, kv_cache_dtype=kv_cache_dtype,
                             calibration=cal, sink_entries=4096)
        stepped = stepwise_logits(model, cache, ids, mask, steps)
        assert cache.lens.tolist() == [n + 6 for n in LENS]
        assert cache.get_seq_length() == ids.shape[1] + 6
        full_ids = torch.cat([ids, steps], 1)
        full_mask = torch.cat([mask, torch.ones_like(steps)], 1)
        one = PagedKVCache(model, len(LENS), 128, kv_cache_dtype=kv_cache_dtype,
                           calibration=cal, sink_entries=4096)
        pos = (full_mask.cumsum(-1) - 1).clamp_min(0)
        once = model(input_ids=full_ids, attention_mask=full_mask, position_ids=pos,
                     past_key_values=one).logits[:, ids.shape[1] - 1:]
        for a, b in zip(cache.buffers, one.buffers):  # the same bytes, in 7 calls or in one
            assert torch.equal(a, b)
        assert torch.allclose(stepped, once, atol=tol, rtol=0), \
            float((stepped - once).abs().max())
        for i, n in enumerate(LENS):
            alone = PagedKVCache(model, 1, 128, kv_cache_dtype=kv_cache_dtype, calibration=cal,
                                 sink_entries=4096)
            row = stepwise_logits(model, alone, ids[i:i + 1, -n:], mask[i:i + 1, -n:],
                                  steps[i:i + 1])
            assert torch.allclose(row[0], stepped[i], atol=tol, rtol=0), (
                i, float((row[0] - stepped[i]).abs().max()))


def test_generate_holds_only_the_format_bytes_and_refuses_bad_input():
    gen = torch.Generator().manual_seed(2)
    model = tiny_llama()
    ids, mask = batch(gen)
    cache = PagedKVCache(model, len(LENS), 128)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (3, ids.shape[1] + 5) and model.config._attn_implementation == NAME
    assert cache.lens.tolist() == [n + 4 for n in LENS]  # the last token is never fed back
    blocks = 3 * (128 // 16)
    assert cache.nbytes == 2 * blocks * 2 * 16 * (64 + 2)  # layers x blocks x Hkv x bs x (D+2)
    assert all(layer.keys is None and layer.values is None for layer in cache.layers)
    with pytest.raises(ValueError, match="past_key_values: the 'turboquant' attention reads"):
        model(input_ids=ids, attention_mask=mask,
              past_key_values=transformers.DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="batch_size: the cache holds 2 rows"):
        model(input_ids=ids, attention_mask=mask, past_key_values=PagedKVCache(model, 2, 128))
    with pytest.raises(ValueError, match="max_length: a row reaches 97 tokens"):
        model(input_ids=ids, attention_mask=mask, past_key_values=PagedKVCache(model, 3, 64))
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        PagedKVCache(model, 3, 64, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="calibration: expected one"):
        PagedKVCache(model, 3, 64, calibration=[])


def test_readme_recipe_runs(tmp_path):
    """README's "Use it with transformers" blocks (model.generate, then continuous batching),
    run as written, with MODEL a local model: SmolLM2's tokenizer beside a small random Llama
    (no download)."""
    import os

    from turboquant.accuracy.models import ModelUnavailable, find_model_path

    try:
        path = find_model_path("smollm2")
    except ModelUnavailable as e:
        pytest.skip(str(e))
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                     gguf_file=os.path.basename(path))
    tok.save_pretrained(tmp_path)
    tiny_llama(vocab=len(tok)).save_pretrained(tmp_path)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Use it with transformers", 1)[1]
    section = section.split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2  # model.generate with PagedKVCache, then continuous batching
    scope = {"MODEL": str(tmp_path)}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    assert len(scope["texts"]) == 2 and all(isinstance(t, str) for t in scope["texts"])
    assert isinstance(scope["cache"], PagedKVCache)
    if transformers.__version__[:4] in ("5.17", "5.23"):  # continuous batching's versions
        exec(compile(blocks[1], "README.md", "exec"), scope)
        assert len(scope["batch_texts"]) == 2
        assert all(isinstance(t, str) for t in scope["batch_texts"])


@pytest.mark.parametrize("device", DEVICES)
def test_static_decode_steps_match_and_replay_from_a_cuda_graph(device):
    """start_decode / advance_decode: decode steps with nothing planned inside the forward give
    the logits of the planned path; on a GPU the whole model step, captured once in a CUDA
    graph, replays them."""
    gen = torch.Generator().manual_seed(3)
    model = tiny_llama().to(device)
    cal = calibration(model, gen)
    ids, mask = (t.to(device) for t in batch(gen))
    steps = torch.randint(1, 128, (len(LENS), 5), generator=gen).to(device)
    tol = 2e-3 if device == "cpu" else 2e-2
    with torch.no_grad():
        planned = PagedKVCache(model, len(LENS), 128, calibration=cal)
        want = stepwise_logits(model, planned, ids, mask, steps)[:, 1:]
        cache = PagedKVCache(model, len(LENS), 128, calibration=cal)
        stepwise_logits(model, cache, ids, mask, steps[:, :0])  # the prefill alone
        cache.start_decode()
        tok = torch.zeros(len(LENS), 1, dtype=torch.long, device=device)
        pos = torch.zeros_like(tok)

        def step():
            return model(input_ids=tok, position_ids=pos, past_key_values=cache).logits[:, -1]

        got, graph = [], None
        for t in range(steps.shape[1]):
            tok.copy_(steps[:, t:t + 1])
            pos.copy_(cache.lens[:, None])
            cache.advance_decode()
            if device == "cpu" or t == 0:
                got.append(step().clone())  # (on the GPU, step 0 is the eager warm-up)
            else:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = step()
                graph.replay()
                got.append(out.clone())
        got = torch.stack(got, 1)
        assert cache.lens.tolist() == planned.lens.tolist()
        assert torch.allclose(got, want, atol=tol, rtol=0), float((got - want).abs().max())
    with pytest.raises(ValueError, match="query: start_decode expects one token"):
        model(input_ids=ids, past_key_values=cache)
