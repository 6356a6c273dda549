"""PyTorch integration: the "switchagg" c10d backend and a DDP comm hook (docs/TORCH.md).

Importing this package registers the backend, so ``init_process_group("switchagg")`` works.
"""

from switchagg.torch.backend import BACKEND_NAME, Network, backend_of, register
from switchagg.torch.calls import configure_from_env
from switchagg.torch.hook import SwitchaggHookState, allreduce_hook
from switchagg.torch.leaving import install as _settle_gloo_at_exit

configure_from_env()  # SWITCHAGG_DEBUG
register()
_settle_gloo_at_exit()  # no abort at interpreter exit (leaving.py)

__all__ = ["BACKEND_NAME", "Network", "backend_of", "SwitchaggHookState", "allreduce_hook", "register"]
