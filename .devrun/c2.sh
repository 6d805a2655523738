# session 5, call 2 (nvidia-h200-x2): install part 2, then GPU0 = DDTREE on FlashInfer MLA (issue 5),
# GPU1 = e2e_step batch 8 at 16K/32K with the admission fix (issue 6).
bash scripts/gpu_host/install.sh .whl-e2e-2 | tail -1
source scripts/gpu_host/env.sh
python3 scripts/make_test_models.py $DDTREE_TEST_MODELS >/dev/null 2>&1 || echo "model generation failed"
R=/tmp/r; mkdir -p $R
T=scripts/gpu_host/run_gpu_tier.sh
(export CUDA_VISIBLE_DEVICES=0 DDTREE_GPU_LOG_ROOT=$R/g0 DDTREE_SERVER_TIMEOUT=480
 DDTREE_E2E_SERVERS=ddtree_flashinfer OUT=$R/ddfi timeout 535 bash $T --only ddtree --dir-timeout 520 >$R/ddfi.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1 DDTREE_SERVER_TIMEOUT=330
 timeout 540 python3 benchmarks/e2e_step.py --configs dflash,ddtree16,ddtree64 --ctx 16384,32768 --batch 8 \
   --profile-steps 0 --deadline-s 530 --tag h200_s5_b8 --out-dir $R/e2e --log-dir $R/e2e-logs >$R/e2e.log 2>&1) &
wait
tail -25 $R/ddfi.log; echo ----; tail -30 $R/e2e.log
du -sh ~/.cache/flashinfer 2>/dev/null; ls ~/.cache 2>/dev/null
cd /tmp && tar czf $OUT/r.tgz r 2>/dev/null; ls -la $OUT
