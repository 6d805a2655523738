# One command to set up, one to test. See README.md.
VPY := .venv/bin/python

.PHONY: setup test apply check-patches bump-reports gpu-test image-test

setup:
	bash scripts/setup_dev.sh

# Re-applies the series first (a no-op when nothing changed) so the tests see the repo as it is.
# pytest exits 5 when it collected nothing: that is a failure here, not a pass.
test: apply
	@$(VPY) -m pytest tests/cpu -q -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

apply:
	@test -x $(VPY) || { echo "error: .venv missing: run 'make setup' first" >&2; exit 1; }
	@PYTHON=$(VPY) bash scripts/apply_patches.sh --python $(VPY) --quiet

check-patches:
	PYTHON=$(VPY) bash scripts/apply_patches.sh --target .cache/upstream/sglang-0.5.17 --check

# On the GPU host, after scripts/gpu_host/install.sh (docs/GPU_HOST.md).
gpu-test:
	bash scripts/gpu_host/run_gpu_tier.sh

# Builds ddtree-sglang:sm120-test (the Dockerfile on a debootstrapped Debian bookworm base) from the
# committed HEAD and tests it in a container, compiling every startup JIT kernel for sm_12x
# (30-50 min on 2 cores; docs/docker.md).
image-test:
	bash scripts/test_image.sh --setup-docker --rm-image

bump-reports:
	for v in 0.5.16 0.5.18 0.5.20 0.5.23; do PYTHON=$(VPY) bash scripts/bump_upstream.sh $$v || true; done
