"""When shards were last written: gathered copies made before a write are stale.

Every optimizer step (a global step hook) and every groupshard load counts as a write;
a storage remembers the count at its last gather and regathers once it moved on.
"""

from __future__ import annotations

_parameter_writes = [0]


def parameter_writes() -> int:
    """How many times shards may have been written (optimizer steps, loads) so far."""
    return _parameter_writes[0]


def note_parameters_written() -> None:
    """Gathered copies made before now are stale: regather before the next use."""
    _parameter_writes[0] += 1
