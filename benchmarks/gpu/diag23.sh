. benchmarks/gpu/prelude.sh
nvidia-smi --query-gpu=name --format=csv
timeout 240 python3 benchmarks/probe_hopper_diag.py --out $OUT 2>&1 | grep -v Warning > $OUT/diag.log; tail -5 $OUT/diag.log
timeout 150 python3 benchmarks/probe_distill.py --reps 3 2>&1 | tee $OUT/distill.log | tail -12
timeout 60 python3 benchmarks/probe_distill.py --reps 3 --tokens 4096 --hs 2048 --ht 2048 --vocab 151936 2>&1 | tee -a $OUT/distill.log | tail -8
