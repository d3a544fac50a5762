"""The programmatic-dependent-launch (pdl) order every op that launches with pdl follows.

With pdl the launcher sets PROGRAMMATIC_STREAM_SERIALIZATION, so a launch may start while the
previous kernel of the stream drains. Before `wait` an op may read only `static` buffers (the
weights: no kernel of a decode step writes them) and write nothing; every activation read and
every store comes after it. `launch_dependents` (once a CTA's last loads are issued) lets the
next launch start overlapping this one's tail: a hint that changes when the next grid starts,
never what it reads. The race audit's `load-before-griddep-wait` rule checks the order in the
PTX and the SASS (validation/race/).

Trace-time helpers (plain Python decides `on`): with `on` false they emit nothing.
"""

from kernels.ops.parts.common import cute


def wait(on) -> None:
    """With pdl, wait until the previous grid has completed and its writes are visible."""
    if on:
        cute.arch.griddepcontrol_wait()


def launch_dependents(on) -> None:
    """With pdl, let the next launch start (after this CTA's last loads are issued)."""
    if on:
        cute.arch.griddepcontrol_launch_dependents()
