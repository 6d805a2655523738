# Source on the GPU host after scripts/gpu_host/install.sh: the installed stack ahead of the image's.
export DDTREE_SITE=${DDTREE_SITE:-/tmp/site}
case ":${PYTHONPATH:-}:" in *":$DDTREE_SITE:"*) ;; *) export PYTHONPATH="$DDTREE_SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The host keeps NVLink multicast off; keep it so in every child process too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DDTREE_TEST_MODELS=${DDTREE_TEST_MODELS:-/tmp/ddtree-models}
