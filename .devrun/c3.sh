# session 5, call 3 (warm): GPU0 = uniform expert routing at 16K batch 1 with the profile (issue 6);
# GPU1 = the FlashInfer MLA hook kernel test (issue 5), then DDTREE B=16/64 at 16K batch 8 (issue 6).
source scripts/gpu_host/env.sh
R=/tmp/r3; mkdir -p $R
(export CUDA_VISIBLE_DEVICES=0 DDTREE_SERVER_TIMEOUT=330
 timeout 560 python3 benchmarks/e2e_step.py --configs dflash,ddtree16,ddtree64 --ctx 16384 --batch 1 --expert-routing uniform \
   --profile-at 16384x1 --deadline-s 550 --tag h200_s5_uniform --out-dir $R/e2e --log-dir $R/e2e-logs >$R/uni.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1 DDTREE_SERVER_TIMEOUT=330
 timeout 150 python3 -m pytest tests/gpu/tree_verify_integration -q -rfEs -k flashinfer_mla -p no:cacheprovider >$R/fimla.log 2>&1
 left=$(( 545 - SECONDS ))
 timeout $left python3 benchmarks/e2e_step.py --configs ddtree16,ddtree64 --ctx 16384 --batch 8 --start-estimate-s 120 \
   --profile-steps 0 --deadline-s $(( left - 10 )) --tag h200_s5_b8_tree --out-dir $R/e2e --log-dir $R/e2e-logs >$R/b8.log 2>&1) &
wait
tail -8 $R/fimla.log; echo ----; tail -12 $R/uni.log; echo ----; tail -10 $R/b8.log
cd /tmp && tar czf $OUT/r3.tgz r3 2>/dev/null; tar czf $OUT/fi-jit.tgz -C /root/.cache flashinfer tvm-ffi 2>/dev/null; ls -la $OUT
