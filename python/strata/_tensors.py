"""Zero-copy views of torch tensors and numpy arrays as (address, elements,
dtype) spans for the native module. Nothing here copies: a tensor that is
not on the CPU, not contiguous or of an unsupported dtype is an error that
names it and says what to do."""

_TORCH_DTYPES = {}
try:
    import torch

    _TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                     torch.float64: "float64", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16",
                     torch.int32: "int32", torch.int64: "int64", torch.bool: "bool"}
except ImportError:  # numpy-only use of strata.io
    torch = None

try:
    import numpy
except ImportError:
    numpy = None


def is_torch_tensor(x):
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(x):
    if is_torch_tensor(x):
        return _TORCH_DTYPES.get(x.dtype, str(x.dtype).replace("torch.", ""))
    return str(x.dtype)


def span(x, what, *, dtypes=None, writable=False):
    """(address, elements, dtype name, bytes) of a CPU, contiguous tensor or array."""
    if is_torch_tensor(x):
        if not x.is_cpu:
            raise ValueError(f"{what} is on {x.device}: strata works on CPU tensors; offload it first "
                             f"(e.g. t.detach().cpu(), or keep an fp32 master copy on the CPU)")
        if x.is_sparse:
            raise ValueError(f"{what} is a sparse tensor: strata needs dense tensors")
        if not x.is_contiguous():
            raise ValueError(f"{what} is not contiguous (strides {tuple(x.stride())}): call .contiguous() first")
        name = dtype_name(x)
        if dtypes is not None and name not in dtypes:
            raise TypeError(f"{what} has dtype {x.dtype}; expected one of {', '.join(dtypes)}")
        return x.data_ptr(), x.numel(), name, x.numel() * x.element_size()
    if numpy is not None and isinstance(x, numpy.ndarray):
        if not x.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{what} is not C-contiguous: use numpy.ascontiguousarray first")
        if writable and not x.flags["WRITEABLE"]:
            raise ValueError(f"{what} is read-only")
        name = str(x.dtype)
        if dtypes is not None and name not in dtypes:
            raise TypeError(f"{what} has dtype {x.dtype}; expected one of {', '.join(dtypes)}")
        return x.ctypes.data, x.size, name, x.nbytes
    raise TypeError(f"{what} is a {type(x).__name__}: expected a torch.Tensor or numpy.ndarray")
