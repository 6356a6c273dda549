"""torch's hook for out-of-tree backends: ``import torch`` calls every entry point of the group
``torch.backends`` (torch/__init__.py, _import_device_backends; TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns
it off). switchagg's registers the "switchagg" c10d backend there, so ``init_process_group("switchagg")``
works without ``import switchagg.torch``. It must never make ``import torch`` fail: a problem is a
warning that names the explicit import.
"""

from __future__ import annotations

import warnings


def register() -> None:
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        import switchagg.torch  # noqa: F401  (importing it registers the backend)
    except Exception as e:  # noqa: BLE001
        warnings.warn(
            f"switchagg: the c10d backend 'switchagg' could not be registered when torch was imported "
            f"({e!r}); `import switchagg.torch` before init_process_group('switchagg') says why",
            RuntimeWarning,
            stacklevel=2,
        )
