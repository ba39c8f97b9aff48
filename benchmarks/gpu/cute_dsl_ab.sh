#!/usr/bin/env bash
# The library's CuTe forward compiled by nvidia-cutlass-dsl 4.2.1 vs 4.8.1 on one H100, in one session:
# bench_cutelib.py (CE forward x one cuBLAS GEMM, CuTe vs Triton interleaved) in alternating processes
# 4.2.1, 4.8.1, 4.2.1, 4.8.1. Needs 4.8.1 installed by `. .dsl2/install.sh` (/tmp/dsl/site-packages)
# and 4.2.1 unpacked from a tarball of its site-packages folder (nvidia_cutlass_dsl + dist-info) into
# /tmp/d421. From the worktree root:  OUT=<dir> bash benchmarks/gpu/cute_dsl_ab.sh [SHAPES]   (<= 300 s)
# The 4.2.1 tarball (43 MB): in a Python 3.12 site-packages with `pip install nvidia-cutlass-dsl==4.2.1`,
#   tar cf - nvidia_cutlass_dsl nvidia_cutlass_dsl-4.2.1.dist-info | xz -T2 -9 --block-size=48MiB > X/dsl421.tar.xz
# with X a git-ignored folder of its own; three calls back to back (each machine stays warm ~30 s):
# carry [X] `mkdir -p /tmp/d421 && tar xJf X/dsl421.tar.xz -C /tmp/d421`; carry [".dsl1"]
# `bash .dsl1/stash.sh`; carry [".dsl2", the tree] `. .dsl2/install.sh && ... cute_dsl_ab.sh`.
set +e
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
shapes=${1:-4096x4096x128256,8192x7168x128256,16384x4096x128256}
base=$PWD/src:$PWD
p421=/tmp/d421/nvidia_cutlass_dsl/python_packages:/tmp/d421
p481=/tmp/dsl/site-packages/nvidia_cutlass_dsl/dsl_packages:/tmp/dsl/site-packages
for i in 1 2; do
  for ver in 421 481; do
    eval "pp=\$p$ver"
    PYTHONPATH=$base:$pp timeout -k 5 70 python3 benchmarks/cute/bench_cutelib.py --shapes "$shapes" --no-logp \
        --rounds 5 --rep 60 --json "$OUT/ab-$ver-$i.json" > "$OUT/ab-$ver-$i.log" 2>&1
    echo "== $ver run $i exit $?"; grep -A4 "N x H x V" "$OUT/ab-$ver-$i.log" | tail -n +2
  done
done
