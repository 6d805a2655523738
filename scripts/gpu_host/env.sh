# SPDX-License-Identifier: Apache-2.0
# Source on the GPU host after scripts/gpu_host/install.sh: the installed stack ahead of the image's.
export DDTREE_SITE=${DDTREE_SITE:-/tmp/site}
case ":${PYTHONPATH:-}:" in *":$DDTREE_SITE:"*) ;; *) export PYTHONPATH="$DDTREE_SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
# Its console scripts (py-spy for the budget sweep's host profiles) after the image's own.
case ":$PATH:" in *":$DDTREE_SITE/bin:"*) ;; *) export PATH="$PATH:$DDTREE_SITE/bin" ;; esac
# The repository root after the installed stack: `benchmarks` and `tests` import as packages, so
# `python3 benchmarks/e2e_step.py` works as well as `python3 -m benchmarks.e2e_step`.
_ddtree_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
case ":$PYTHONPATH:" in *":$_ddtree_repo:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$_ddtree_repo" ;; esac
unset _ddtree_repo
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The host keeps NVLink multicast off; keep it so in every child process too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DDTREE_TEST_MODELS=${DDTREE_TEST_MODELS:-/tmp/ddtree-models}
# This is the GPU host: in the GPU tier a skip is a failure there (tests/gpu/conftest.py).
export DDTREE_GPU_HOST=${DDTREE_GPU_HOST:-1}
