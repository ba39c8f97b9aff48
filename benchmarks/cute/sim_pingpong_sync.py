"""A model of the ping-pong forward's synchronisation (fused_forward_pingpong.py), run on a CPU.

    python benchmarks/cute/sim_pingpong_sync.py [--seeds 20]

The kernel's protocol, step by step, under random interleavings of its three agents:
  * the producer fills ring counts c = 0 .. n_here * K - 1 in order (slot c % stages), each
    after the empty barrier of its slot completed phase c // stages (the release of c - stages);
  * consumer warpgroup g runs tiles j = g, g + 2, ... of the split: for j > 0 it first waits on
    the other warpgroup's "issued" named barrier; per k slab it waits on the full barrier of
    its count with the parity (c // stages) % 2 (an mbarrier wait names a phase by its parity
    only: it passes whenever the barrier's completed-phase count has the other parity), issues
    the wgmma, and releases the previous count (wait_group(1)); after the last slab it arrives
    on its own barrier if a tile j + 1 exists, then releases its last count.
It asserts, for every (K, stages, tiles) and schedule: no deadlock, every parity wait passes
only at exactly the fill it wants (no ABA), releases in order, every named-barrier phase
completed at the end. The same model without the ordering barrier must fail (ABA): a check
that the model can catch what the barrier prevents. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys


def run(k_tiles: int, stages: int, n_here: int, ordered: bool = True, seed: int = 0) -> str:
    rng = random.Random(seed)
    fills = [0] * stages  # completed phases of each full barrier
    rels = [0] * stages  # completed phases of each empty barrier
    arrives = [0, 0]  # arrivals of warpgroup g on its "issued" barrier
    syncs = [0, 0]  # completed waits of warpgroup g on the other's barrier

    def consumer(w):
        for j in range(w, n_here, 2):
            if ordered and j > 0:
                while arrives[1 - w] < syncs[w] + 1:
                    yield "blocked"
                syncs[w] += 1
            pend = None
            for kt in range(k_tiles):
                c = j * k_tiles + kt
                s, f = c % stages, c // stages
                while fills[s] % 2 == f % 2:  # try_wait.parity(f % 2) not yet satisfied
                    yield "blocked"
                if fills[s] != f + 1:
                    raise AssertionError(f"ABA: warpgroup {w} count {c} passed at fill {fills[s]}")
                yield "ok"  # the wgmma of this slab
                if pend is not None:  # wait_group(1): the previous slab's group retired
                    if rels[pend % stages] != pend // stages:
                        raise AssertionError("release out of order")
                    rels[pend % stages] += 1
                pend = c
            if ordered and j + 1 < n_here:
                arrives[w] += 1
            if pend is not None:
                rels[pend % stages] += 1
            yield "ok"  # the epilogue

    def producer():
        for c in range(n_here * k_tiles):
            s, f = c % stages, c // stages
            while rels[s] < f:
                yield "blocked"
            if rels[s] != f:
                raise AssertionError("producer ABA")
            fills[s] += 1
            yield "ok"

    agents = [producer(), consumer(0), consumer(1)]
    done = [False] * 3
    idle = 0
    while not all(done):
        live = [i for i in range(3) if not done[i]]
        rng.shuffle(live)
        progressed = False
        for i in live:
            try:
                step = next(agents[i])
            except StopIteration:
                done[i] = progressed = True
                continue
            if step == "ok":
                progressed = True
                break
        idle = 0 if progressed else idle + 1
        if idle > 50:
            return "deadlock"
    if ordered and (arrives[0] != syncs[1] or arrives[1] != syncs[0]):
        return "dangling named-barrier phase"
    return "ok"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    out = {}
    for ordered in (True, False):
        fails = []
        n_runs = 0
        for k in (1, 2, 3, 4, 5, 7, 64, 112):  # H = 64 .. 7168
            for stages in (4, 5):
                for n_here in (0, 1, 2, 3, 4, 5, 8):
                    for seed in range(args.seeds):
                        n_runs += 1
                        try:
                            r = run(k, stages, n_here, ordered, seed)
                        except AssertionError as exc:
                            r = str(exc)
                        if r != "ok":
                            fails.append((k, stages, n_here, seed, r[:60]))
        out["ordered" if ordered else "unordered"] = {"runs": n_runs, "failures": len(fails),
                                                      "first": fails[:3]}
    out["ok"] = out["ordered"]["failures"] == 0 and out["unordered"]["failures"] > 0
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
