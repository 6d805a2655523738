import os

# Tests that run Triton kernels on the CPU need the interpreter; set it before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
