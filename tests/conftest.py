"""Suite-wide setup. Helpers live in plain modules (factories.py, waiting.py, kernel_testing.py, ...)."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when a kernel module is imported, so it is set here, before
# any test module imports one: on a machine without CUDA the kernel tests run the Triton
# kernels through the interpreter on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
