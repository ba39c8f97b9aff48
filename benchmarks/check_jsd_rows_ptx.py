"""Are two trees' row-statistics JSD kernels (triton_lib/jsd_rows.py: the one-pass forward
and the split phases 1, 2 and 3) the
same machine code? AOT compile for sm_90 on the CPU (the configurations of
``check_jsd_rows_asm.py`` plus a 4-row block), PTX with line info stripped:

    PYTHONPATH=<tree>/src python benchmarks/check_jsd_rows_ptx.py save FILE
    python benchmarks/check_jsd_rows_ptx.py compare A B

A pure refactor (helpers that Triton inlines) must leave the PTX unchanged: then every
result on the GPU is bitwise the same.
"""

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
sys.path.insert(0, os.path.dirname(__file__))


def save(path: str) -> int:
    from check_jsd_rows_asm import compile_one

    from logitless.triton_lib import jsd_rows as R

    out = {}
    for mode in (0, 1, 2):
        for hard in (False, True):
            base = dict(MODE=mode, HAS_CAP_S=hard, HAS_CAP_T=hard)
            jobs = [(R.jsd_partial_kernel, dict(base, HAS_HARD=hard, BLOCK_N=1, BLOCK_V=4096, BLOCKS_PER_SPLIT=4), 8),
                    (R.jsd_partial_kernel, dict(base, HAS_HARD=hard, BLOCK_N=4, BLOCK_V=1024, BLOCKS_PER_SPLIT=2), 4)]
            jobs += [(R.jsd_finish_kernel, dict(MODE=mode, HAS_HARD=hard, HAS_CAP_S=hard, BLOCK_N=128), 4),
                     (R.jsd_forward_kernel, dict(base, HAS_HARD=hard, BLOCK_N=1, BLOCK_V=4096), 8)]
            if mode == 0:
                jobs += [(R.jsd_divergence_kernel, dict(base, BLOCK_N=1, BLOCK_V=4096, BLOCKS_PER_SPLIT=4), 8),
                         (R.jsd_divergence_kernel, dict(base, BLOCK_N=4, BLOCK_V=1024, BLOCKS_PER_SPLIT=2), 4)]
            for fn, c, w in jobs:
                ptx = compile_one(fn, c, w).asm["ptx"]
                ptx = "\n".join(line for line in ptx.splitlines()
                                if not line.strip().startswith((".loc", ".file", "//")))
                out[f"{fn.__name__} {sorted(c.items())} warps={w}"] = ptx
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"{len(out)} kernels saved to {path}")
    return 0


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    same = [k for k in a if a[k] == b.get(k)]
    for k in a:
        if k not in same:
            print("DIFFERENT:", k)
    print(f"{len(same)} of {len(a)} kernels: identical PTX")
    return 0 if len(same) == len(a) == len(b) else 1


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "save" and len(sys.argv) == 3:
        sys.exit(save(sys.argv[2]))
    if cmd == "compare" and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    sys.exit(__doc__)
