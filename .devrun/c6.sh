# session 5, call 6 (fresh nvidia-h200-x2, after install part 1): GPU0 = batch 8 at 1K/32K with one-chunk prefill
# (issue 6); GPU1 = DDTREE B=63 vs B=64 vs B=32 under uniform routing at 16K (the MoE tile cliff at M > E).
bash scripts/gpu_host/install.sh .whl-e2e-2 | tail -1
source scripts/gpu_host/env.sh
python3 scripts/make_test_models.py $DDTREE_TEST_MODELS >/dev/null 2>&1 || echo "model generation failed"
R=/tmp/r6; mkdir -p $R; export DDTREE_SERVER_TIMEOUT=300
(CUDA_VISIBLE_DEVICES=0 timeout 520 python3 benchmarks/e2e_step.py --configs dflash,ddtree64,ddtree16 --ctx 1024,32768 --batch 8 \
   --profile-steps 0 --deadline-s 505 --tag h200_s5_b8_32k --out-dir $R/e2e --log-dir $R/logs0 >$R/b8.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 520 python3 benchmarks/e2e_step.py --configs ddtree63,ddtree64,ddtree32 --ctx 16384 --batch 1 \
   --expert-routing uniform --profile-at 16384x1 --deadline-s 505 --tag h200_s5_budget_uniform --out-dir $R/e2e --log-dir $R/logs1 >$R/bud.log 2>&1) &
wait
grep -v '^{' $R/b8.log | tail -14; echo ----; grep -v '^{' $R/bud.log | tail -14
cd /tmp && tar czf $OUT/r6.tgz r6; ls -la $OUT
