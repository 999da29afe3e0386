"""The dtypes a model's state may have in a stored version, by the names layouts and store arrays use."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["dtype_name", "torch_dtype"]

# torch dtypes a layout can hold, by the name used in layouts and store arrays.
_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype | np.dtype | str) -> str:
    """The layout name of a torch or numpy dtype, e.g. ``torch.float32 -> "float32"``.

    Raises
    ------
    TypeError
        If the dtype cannot be stored; the message lists the ones that can.
    """
    if isinstance(dtype, torch.dtype):
        name = _NAMES.get(dtype)
    else:
        name = np.dtype(dtype).name if str(dtype) != "bfloat16" else "bfloat16"
        name = name if name in _DTYPES else None
    if name is None:
        raise TypeError(f"cannot store parameters of dtype {dtype!r}; supported dtypes: {sorted(_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise TypeError(f"unknown parameter dtype {name!r}; supported dtypes: {sorted(_DTYPES)}") from None
