"""The engine layer the vLLM backend runs (``turboquant.integration.vllm.layer``, no vLLM needed):
steps of a serving engine (chunked prefill beside decodes and speculative verification, padded
token rows, shuffled block tables) over one byte buffer holding two layers in vLLM's LBNHC
layout, poisoned where unused, against the same steps through the API on ``allocate_cache``,
and against fp32 attention over the unquantized keys and values. On a GPU, the same steps
replayed from a CUDA graph captured once."""
import math

import pytest
import torch

import turboquant as tq
from turboquant.calls import leading_decodes
from turboquant.integration.vllm.layer import (PagedLayer, StepMetadata, bytes_per_token_head,
                                               layer_bytes)

HQ, HKV, D, BS, NB = 8, 2, 64, 16, 40
# per step, each sequence's query tokens (0: not scheduled); final lengths 1, 54, 97, 17, 30
STEPS = [[1, 32, 48, 16, 0],
         [0, 22, 48, 1, 26],
         [0, 0, 1, 0, 4],  # a speculative verification of 4 tokens
         ]
PAD = 3  # padding rows after the real tokens (slot -1), as an engine pads for a CUDA graph


def engine_buffer(num_layers: int, key_format: str, device="cpu") -> list:
    """vLLM's LBNHC allocation: one raw buffer, each layer a [NB, HKV, BS, C] view whose physical
    order is (block, token, head, byte); filled with 0xFF (NaN scales) before any write."""
    c = bytes_per_token_head(D, key_format)
    page = BS * HKV * c
    raw = torch.full((num_layers * NB * page,), 0xFF, dtype=torch.uint8, device=device)
    return [raw[i * NB * page:].as_strided((NB, HKV, BS, c), (page, c, HKV * c, 1))
            for i in range(num_layers)]


def schedule(gen, device):
    """Block tables (shuffled ids, unused entries garbage) and each step's tokens."""
    lens = [sum(s[i] for s in STEPS) for i in range(len(STEPS[0]))]
    per = [math.ceil(n / BS) for n in lens]
    ids = torch.randperm(NB, generator=gen)[:sum(per)].tolist()
    width = max(per) + 1
    table = torch.randint(0, NB, (len(lens), width), generator=gen, dtype=torch.int32)
    at = 0
    for i, n in enumerate(per):
        table[i, :n] = torch.tensor(ids[at:at + n], dtype=torch.int32)
        at += n
    steps, done = [], [0] * len(lens)
    for qs in STEPS:
        live = [i for i, q in enumerate(qs) if q]
        pos = [p for i in live for p in range(done[i], done[i] + qs[i])]
        seq = [i for i in live for _ in range(qs[i])]
        for i in live:
            done[i] += qs[i]
        steps.append(dict(live=live, seq=seq, pos=pos,
                          seq_lens=torch.tensor([done[i] for i in live], dtype=torch.int32),
                          cu=torch.tensor([0] + list(torch.tensor([qs[i] for i in live])
                                                     .cumsum(0)), dtype=torch.int32)))
    return table.to(device), steps, lens


def slots_of(table, seq, pos):
    s = torch.tensor(seq, dtype=torch.long)
    p = torch.tensor(pos, dtype=torch.long)
    return table.cpu()[s, p // BS].long() * BS + p % BS


def fp32_attention(q, k, v, scale, causal_from):
    """q [n, HQ, D] at positions causal_from.. over k, v [L, HKV, D]: fp32 reference."""
    g = HQ // HKV
    kk, vv = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale
    qpos = torch.arange(q.shape[0])[:, None] + causal_from
    s = s.masked_fill(torch.arange(k.shape[0])[None] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_format", ["fp4", "fp8_e4m3"])
def test_engine_steps_match_the_api_and_fp32(key_format, device, monkeypatch):
    import turboquant.integration.vllm.layer as layer_module
    given = []  # the workspace each attention call of the layer was given

    def spy(*args, **kwargs):
        given.append(kwargs.get("workspace"))
        return tq.paged_attention_fp4(*args, **kwargs)
    monkeypatch.setattr(layer_module, "paged_attention_fp4", spy)
    gen = torch.Generator().manual_seed(11)
    table, steps, lens = schedule(gen, device)
    kv = {(layer, i): (torch.randn(n, HKV, D, generator=gen).bfloat16(),
                       torch.randn(n, HKV, D, generator=gen).bfloat16())
          for layer in range(2) for i, n in enumerate(lens)}
    buffers = engine_buffer(2, key_format, device)
    layers = [PagedLayer(HQ, D, HKV, D ** -0.5, key_format=key_format) for _ in range(2)]
    api_caches = [tq.allocate_cache(NB, HKV, BS, D, key_format=key_format, fill=0xFF,
                                    device=device) for _ in range(2)]
    api_states = [tq.allocate_shared_state(HKV, D, NB, device=device) for _ in range(2)]
    for step, st in enumerate(steps):
        n = len(st["seq"])
        st = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
        slots = torch.cat([slots_of(table, st["seq"], st["pos"]),
                           torch.full((PAD,), -1)]).to(device)
        # steps 0 and 2 start with a decode: the layer runs it as its own call
        # the engine's workspace, poisoned (its contents are never read before written)
        msl = int(st["seq_lens"].max())
        nbytes = tq.prefill_workspace_bytes(len(st["live"]), msl, HKV, D, key_format=key_format,
                                            device=device)
        ws = torch.full((max(nbytes, 16),), 0xFF, dtype=torch.uint8, device=device)
        meta = StepMetadata.build(st["cu"], st["seq_lens"], table[st["live"]], slots, n, msl,
                                  num_decodes=leading_decodes(st["cu"].cpu(), len(st["live"])),
                                  workspace=ws)
        assert meta.num_decodes == [1, 0, 1][step]
        assert meta.positions.tolist() == st["pos"]
        for layer in range(2):
            k = torch.cat([kv[layer, i][0][p:p + 1] for i, p in zip(st["seq"], st["pos"])]
                          + [torch.randn(PAD, HKV, D, generator=gen).bfloat16()]).to(device)
            v = torch.cat([kv[layer, i][1][p:p + 1] for i, p in zip(st["seq"], st["pos"])]
                          + [torch.randn(PAD, HKV, D, generator=gen).bfloat16()]).to(device)
            q = torch.randn(n + PAD, HQ, D, generator=gen).bfloat16().to(device)
            out = torch.full_like(q, 7.0)
            layers[layer].forward(q, k, v, buffers[layer], meta, out)
            assert given.pop() is ws and not given
            assert torch.equal(out[n:], torch.full_like(out[n:], 7.0))  # padding rows untouched
            cache = api_caches[layer]
            tq.reshape_and_cache_fp4(k[:n], v[:n], *cache, slots[:n], positions=meta.positions,
                                     shared_state=api_states[layer])
            ref = tq.paged_attention_fp4(q[:n], *cache, table[st["live"]], st["seq_lens"],
                                         D ** -0.5, cu_query_lens=st["cu"],
                                         shared_state=api_states[layer],
                                         num_decodes=meta.num_decodes)
            assert torch.equal(out[:n], ref)
            for j, i in enumerate(st["live"]):
                rows = slice(int(st["cu"][j]), int(st["cu"][j + 1]))
                L = int(st["seq_lens"][j])
                want = fp32_attention(q[rows].cpu(), kv[layer, i][0][:L], kv[layer, i][1][:L],
                                      D ** -0.5, L - (rows.stop - rows.start))
                err = (out[rows].float().cpu() - want).norm() / want.norm()
                assert err < 0.25, (i, float(err))  # FP4 values: ~0.13 per vector
    for layer in range(2):  # the same bytes as the API's cache, block by block
        for region, ref in zip(layers[layer].cache(buffers[layer]), api_caches[layer]):
            assert torch.equal(region.view(torch.uint8), ref.view(torch.uint8))


def test_layer_bytes_refuses_a_layout_with_gaps():
    c = bytes_per_token_head(D, "fp4")
    page = BS * HKV * c
    raw = torch.zeros(2 * NB * page, dtype=torch.uint8)
    # vLLM's BLNHC: a block of every layer's pages, so a layer's blocks are a page apart
    blnhc = raw.as_strided((NB, HKV, BS, c), (2 * page, c, HKV * c, 1))
    with pytest.raises(ValueError, match="kv_cache: the layer's bytes are not one dense range.*"
                                         "LBNHC"):
        layer_bytes(blnhc)
    lbhnc = raw[:NB * page].view(NB, HKV, BS, c)
    assert layer_bytes(lbhnc).data_ptr() == raw.data_ptr()
    layer = PagedLayer(HQ, D, HKV, D ** -0.5)
    with pytest.raises(ValueError, match="kv_cache: .* is not 40 blocks"):
        layer.cache(raw[:NB * page + NB].view(NB, -1))
    with pytest.raises(ValueError, match="config: 'rotation[+]smooth[+]sink' keeps a record"):
        PagedLayer(HQ, D, HKV, 1.0, config=tq.config.PER_SEQUENCE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_steps_replay_from_one_cuda_graph():
    """Uniform decode steps (and 4-token verification) captured once with vLLM's capture
    metadata (max_seq_len at the table's capacity), replayed with new lengths, slots and tokens:
    the same outputs, bit for bit, as eager calls with that metadata on a second buffer."""
    dev = "cuda"
    gen = torch.Generator().manual_seed(5)
    nseq, width = 6, 6
    table = torch.randperm(NB, generator=gen)[:nseq * width].view(nseq, width).to(torch.int32)
    table = table.to(dev)
    for q_len in (1, 4):
        buf = engine_buffer(1, "fp4", dev)[0]
        eager_buf = engine_buffer(1, "fp4", dev)[0]
        layer, eager = PagedLayer(HQ, D, HKV, D ** -0.5), PagedLayer(HQ, D, HKV, D ** -0.5)
        prompt = torch.tensor([40, 3, 77, 60, 17, 64])
        n = nseq * q_len
        pos = torch.cat([torch.arange(p) for p in prompt.tolist()])
        seq = torch.repeat_interleave(torch.arange(nseq), prompt)
        slots = (table.cpu()[seq, pos // BS].long() * BS + pos % BS).to(dev)
        k = torch.randn(len(pos), HKV, D, generator=gen).bfloat16().to(dev)
        v = torch.randn(len(pos), HKV, D, generator=gen).bfloat16().to(dev)
        cu = torch.cat([torch.zeros(1), prompt.cumsum(0)]).to(torch.int32).to(dev)
        pre = StepMetadata.build(cu, prompt.to(torch.int32).to(dev), table, slots, len(pos),
                                 int(prompt.max()))
        for lay, b in ((layer, buf), (eager, eager_buf)):  # the prompts, eagerly
            q = torch.randn(len(pos), HQ, D, generator=gen).bfloat16().to(dev)
            lay.forward(q, k, v, b, pre, torch.empty_like(q))
        # persistent step inputs, as vLLM keeps them for its graphs
        lens = prompt.to(torch.int32).to(dev) + q_len
        cu = (torch.arange(nseq + 1, dtype=torch.int32) * q_len).to(dev)
        slot = torch.zeros(n, dtype=torch.long, device=dev)
        q = torch.zeros(n, HQ, D, dtype=torch.bfloat16, device=dev)
        kn = torch.zeros(n, HKV, D, dtype=torch.bfloat16, device=dev)
        vn = torch.zeros_like(kn)
        out = torch.zeros_like(q)
        meta = StepMetadata.build(cu, lens, table, slot, n, width * BS)

        def fill(step):
            now = prompt + q_len * (step + 1)
            p = torch.cat([torch.arange(x - q_len, x) for x in now.tolist()])
            s = torch.repeat_interleave(torch.arange(nseq), q_len)
            lens.copy_(now.to(torch.int32))
            slot.copy_(table.cpu()[s, p // BS].long() * BS + p % BS)
            meta.positions.copy_(p)
            for t in (q, kn, vn):
                t.copy_(torch.randn(t.shape, generator=gen).bfloat16())

        fill(0)
        layer.forward(q, kn, vn, buf, meta, out)  # warm-up, eager (as vLLM's)
        eager.forward(q, kn, vn, eager_buf, meta, torch.empty_like(out))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer.forward(q, kn, vn, buf, meta, out)
        for step in range(1, 4):
            fill(step)
            graph.replay()
            want = eager.forward(q, kn, vn, eager_buf, meta, torch.empty_like(out))
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
            assert torch.equal(out, want), (q_len, step)
