"""The sm120 backend on a machine without an SM120 GPU: importing builds nothing, the backend
says why it cannot run, its ops carry the shared schema, and auto dispatch never picks it."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from turboquant.config import PLAIN

import turboquant
from turboquant import registry
from turboquant.api import make_attention_call
from turboquant._backends import sm120
from turboquant.ops import ATTENTION_SCHEMA

ROOT = Path(__file__).resolve().parents[1]


def _cpu_call():
    d, bs = 128, 16
    return make_attention_call(torch.zeros(1, 4, d, dtype=torch.bfloat16),
                               torch.zeros(2, 2, bs, d // 2, dtype=torch.uint8),
                               torch.zeros(2, 2, bs, d // 2, dtype=torch.uint8),
                               torch.full((2, bs, 2), 127, dtype=torch.uint8),
                               torch.full((2, bs, 2), 127, dtype=torch.uint8),
                               torch.zeros(1, 2, dtype=torch.int32),
                               torch.tensor([3], dtype=torch.int32), 0.1)


def test_import_builds_nothing_and_registers():
    assert sm120._state == {} or torch.cuda.is_available()
    backend = registry.get("sm120")
    assert backend is sm120.BACKEND and backend.priority == 70
    assert any(r["name"] == "sm120" for r in registry.status())


def test_unavailable_says_compute_capability_12():
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 12:
        return
    reason = sm120.BACKEND.unavailable()
    assert reason is not None and "compute capability 12" in reason
    assert sm120._state == {}  # deciding that built nothing


def test_ops_use_the_shared_schema():
    for emulate in (False, True):
        attention, probe = sm120.op_names(emulate)
        op = getattr(torch.ops.turboquant, attention.split("::")[1]).default
        assert str(op._schema) == attention + ATTENTION_SCHEMA
        assert hasattr(torch.ops.turboquant, probe.split("::")[1])


def test_binding_implements_exactly_the_defined_ops():
    text = (ROOT / "csrc_cuda" / "sm120" / "torch_binding_sm120.cu").read_text()
    impls = re.findall(r'm\.impl\("(\w+)" TQ_SM120_SUFFIX', text)
    assert sorted(impls) == ["paged_attention_fp4_sm120", "sm120_mma_probe"]
    assert "TORCH_LIBRARY_FRAGMENT" not in text and "m.def" not in text  # schemas live in Python


def test_declines_cpu_tensors_and_auto_never_picks_it_here():
    call = _cpu_call()
    assert "not on a CUDA device" in sm120.BACKEND.check_attention(call)
    assert registry.select("auto", "attention", call).name != "sm120"
    out = turboquant.paged_attention_fp4(call.query, call.key_cache, call.value_cache, call.key_scales,
                                         call.value_scales, call.block_tables, call.seq_lens, 0.1,
                                         config=PLAIN)
    assert out.shape == call.query.shape
