bash scripts/gpu_host/install.sh .whl-e2e-1
