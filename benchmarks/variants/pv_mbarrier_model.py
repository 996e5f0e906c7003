"""Random-schedule model of prefill_pv_mbarrier.patch's hand-offs between the producer and the
row warps: mbarriers with a count, a phase and parity waits (a wait on parity P passes once the
phase of parity P has completed); each warp runs the patch's sequence of arrivals and waits
(three CTA barriers, the FULL / EMPTY hand-offs with the round parity, DONE). Checked: every
schedule ends (no deadlock), no tile is rewritten before every row warp handed it back, no row
warp reads a tile before every producer warp wrote it. Mutations (the EMPTY or FULL parity
flipped, one EMPTY arrival dropped) fail it.
    python benchmarks/variants/pv_mbarrier_model.py"""
import random

class MB:
    def __init__(s, count): s.count = count; s.pending = count; s.phase = 0
    def arrive(s):
        s.pending -= 1
        assert s.pending >= 0
        if s.pending == 0: s.phase += 1; s.pending = s.count
    def passed(s, parity): return (s.phase & 1) != parity

def run(NDEC, N, W, rng):
    FULL = [MB(W) for _ in range(NDEC)]; EMPTY = [MB(W) for _ in range(NDEC)]
    CTA = MB(2 * W); DONE = MB(2 * W)
    tile_step = [None] * NDEC          # step held by tile b (all producer warps wrote it)
    writes = [dict() for _ in range(NDEC)]  # tile -> {step: warps written}
    released = {}                      # step -> consumer warps that handed its tile back
    reading = [set() for _ in range(NDEC)]  # consumer warps still reading tile b
    def cta_syncs():  # the Q prescale's two CTA barriers and the one after Q
        ph = 0
        for _ in range(3):
            CTA.arrive()
            while not CTA.passed(ph): yield
            ph ^= 1
    def producer(w):
        yield from cta_syncs()
        b = rnd = 0
        for j in range(N):
            if j >= NDEC:
                while not EMPTY[b].passed(rnd ^ 1): yield
                assert released.get(j - NDEC, 0) == W, ("overwrite before release", j)
            writes[b][j] = writes[b].get(j, 0) + 1
            yield
            FULL[b].arrive()
            b += 1
            if b == NDEC: b = 0; rnd ^= 1
        DONE.arrive()
        while not DONE.passed(0): yield
    def consumer(w):
        yield from cta_syncs()
        b = rnd = 0; b_prev = NDEC - 1
        for k in range(N + 1):
            if k < N:
                while not FULL[b].passed(rnd): yield
                assert writes[b].get(k, 0) == W, ("read before full", k, writes[b])
            yield  # S(k), P V(k - 1), softmax
            if k > 0 and k - 1 + NDEC < N:
                EMPTY[b_prev].arrive(); released[k - 1] = released.get(k - 1, 0) + 1
            b_prev = b
            b += 1
            if b == NDEC: b = 0; rnd ^= 1
        DONE.arrive()
        while not DONE.passed(0): yield
    gens = [producer(w) for w in range(W)] + [consumer(w) for w in range(W)]
    live = list(range(len(gens))); steps = 0
    while live:
        i = rng.choice(live); steps += 1
        try: next(gens[i])
        except StopIteration: live.remove(i)
        assert steps < 200000, "deadlock"
    return True

rng = random.Random(1)
n = 0
for NDEC in (3, 4):
    for N in range(0, 14):
        for W in (1, 2, 3):
            for _ in range(60):
                run(NDEC, N, W, rng); n += 1
print("ok", n, "random schedules, NDEC 3/4, nsteps 0-13, 1-3 warps per role")
