"""Strata for PyTorch users: the CPU optimizers (strata.optim), NVMe tensor
I/O (strata.io), config checks (strata.config) and memory estimates
(strata.estimate) of the Strata engine, and the engine itself driven from
Python (strata.engine), through one native module.

    import strata
    opt = strata.optim.CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)

See docs/python.md.
"""

# torch (when installed) loads before the native module: _native links the system's NCCL (comm's nccl
# backend), and a CUDA build of torch loaded after it binds to that library instead of its own and fails
# ("libtorch_cuda.so: undefined symbol: ncclCommResume" with torch 2.15+cu132).
try:
    import torch  # noqa: F401
except ImportError as e:
    if e.name != "torch":
        raise  # torch is there but failed to import: its own error says why

from . import _native
from .errors import *  # noqa: F401,F403
from .errors import _BY_CODE

_native._register_errors(_BY_CODE)

from . import config, engine, io  # noqa: E402

try:
    from . import optim  # noqa: E402
except ImportError as e:  # torch is missing: the rest of the package (config, estimate, io on numpy) works
    if e.name != "torch":
        raise  # torch is there but failed to import: its own error says why
    _OPTIM_MISSING = ("strata.optim needs PyTorch (its optimizers step torch tensors): pip install torch (or, on "
                      "Debian, apt-get install python3-torch and use /usr/bin/python3)")

    def __getattr__(name):
        if name == "optim":
            raise ImportError(_OPTIM_MISSING)
        raise AttributeError(f"module 'strata' has no attribute '{name}'")
from .estimate import estimate  # noqa: E402

__version__ = _native.__version__
build_info = _native.build_info

__all__ = ["optim", "io", "config", "engine", "estimate", "build_info", "__version__"] + errors.__all__  # noqa: F405
