"""A random-schedule model of the SM90a prefill kernel's named barriers (csrc_cuda/
attention_prefill.cuh, the wgmma path): the producer warps (one agent, 256 threads) and the
two warpgroups of rows (128 threads each) run the kernel's sequence of bar.sync / bar.arrive per
step: FULL + NDEC w + b (one per warpgroup), EMPTY + b (both hand a tile back), the turns
TURN + w of the ping-pong, and the CTA barrier after the loop. A named barrier completes when
its thread count has arrived, whoever arrived. Checked: every schedule ends (no deadlock), no
warpgroup reads a tile that does not hold its step (no rewrite before both handed it back).
Mutations that must fail: one FULL barrier for both warpgroups (the first version of the
ping-pong, which hung on the device) and the missing extra turn after warpgroup 0's loop."""
import random

import pytest

PROD, WG = 256, 128


def programs(n, ndec, wgs, shared_full=False, final_turn=True):
    full = (lambda w, b: f"F{b}") if shared_full else (lambda w, b: f"F{w}.{b}")
    prod = []
    for j in range(n):
        if j >= ndec:
            prod.append(("sync", f"E{j % ndec}", PROD))
        prod.append(("write", j % ndec, j))
        for w in range(1 if shared_full else wgs):
            prod.append(("arrive", full(w, j % ndec), PROD))
    prod.append(("sync", "CTA", PROD))
    progs = [prod]
    turns = wgs == 2
    for w in range(wgs):
        c = [("sync", "T1", WG)] if turns and w == 1 else []
        for k in range(n):
            c.append(("sync", full(w, k % ndec), WG))
            c.append(("read", k % ndec, k))  # S(k)
            if turns:
                c.append(("arrive", f"T{1 - w}", WG))
            if k > 0 and k - 1 + ndec < n:  # after the wait for S(k) and P V(k - 1)
                c.append(("arrive", f"E{(k - 1) % ndec}", WG))
            if turns:
                c.append(("sync", f"T{w}", WG))
            c.append(("read", k % ndec, k))  # P V(k)
        if turns and w == 0 and final_turn:
            c.append(("arrive", "T1", WG))
        c.append(("sync", "CTA", WG))
        progs.append(c)
    return progs


def expected(name, wgs, shared_full):
    if name.startswith("F"):
        return PROD + WG * (wgs if shared_full else 1)
    if name.startswith("T"):
        return 2 * WG
    return PROD + WG * wgs


def run(n, ndec, wgs, rng, **kw):
    """True if the schedule ends; asserts what every tile read finds."""
    progs = programs(n, ndec, wgs, **kw)
    pc, waiting, bars, tile = [0] * len(progs), [None] * len(progs), {}, {}
    while True:
        ready = [a for a, p in enumerate(progs) if pc[a] < len(p) and waiting[a] is None]
        if not ready:
            return all(pc[a] == len(p) for a, p in enumerate(progs))
        a = rng.choice(ready)
        op = progs[a][pc[a]]
        pc[a] += 1
        if op[0] == "write":
            tile[op[1]] = op[2]
            continue
        if op[0] == "read":
            assert tile.get(op[1]) == op[2], f"step {op[2]} read tile {op[1]} holding {tile.get(op[1])}"
            continue
        kind, name, count = op
        arrived, sleepers = bars.setdefault(name, [0, []])
        arrived += count
        if kind == "sync":
            sleepers.append(a)
            waiting[a] = name
        need = expected(name, wgs, kw.get("shared_full", False))
        assert arrived <= need, f"barrier {name} over-arrived"
        if arrived == need:
            for s in sleepers:
                waiting[s] = None
            bars[name] = [0, []]
        else:
            bars[name] = [arrived, sleepers]


def test_turns_never_deadlock_nor_read_a_rewritten_tile():
    rng = random.Random(0)
    for _ in range(3000):
        n, ndec, wgs = rng.randint(0, 10), rng.choice([3, 4]), rng.choice([1, 2, 2])
        assert run(n, ndec, wgs, rng), (n, ndec, wgs)


@pytest.mark.parametrize("mutation", [{"shared_full": True}, {"final_turn": False}])
def test_model_catches_the_broken_protocols(mutation):
    rng = random.Random(1)
    assert not all(run(rng.randint(1, 10), rng.choice([3, 4]), 2, rng, **mutation) for _ in range(200))
