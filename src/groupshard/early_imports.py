"""torch modules that groupshard imports before any process group exists, so that none of
them keeps one alive past ``destroy_process_group()`` (docs/when-something-fails.md).

A group that outlives its destroy keeps gloo's worker threads running; at interpreter
shutdown one still releasing a finished collective's tensors aborts the process
("terminate called without an active exception"). Two of torch's lazy imports held one:

- ``torch.distributed.nn.functional`` takes the default group as a default argument when
  first imported (``torch._dynamo`` imports it);
- ``torch._dynamo``, which torch imports on the first ``Optimizer.add_param_group`` or
  ``torch.compiler.disable``, runs ``torch.fx.wrap``, whose frame holds itself in a local:
  through ``f_back`` that cycle holds every frame of the import up to the caller's, with
  their locals (``gs.shard``'s process group, a ZeRO optimizer's), until the garbage
  collector next runs (issue 51). One collection right after the import frees it.
"""

from __future__ import annotations

import gc
import sys


def import_early() -> None:
    """Import both modules now (once per process); free the frames the import left."""
    if "torch._dynamo" in sys.modules:
        return
    import torch._dynamo
    import torch.distributed.nn.functional  # noqa: F401

    gc.collect()
