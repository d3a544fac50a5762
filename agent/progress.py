"""Progress display for long runs: turn, stage, attempt, best result so far, and budget spent.

On a terminal it is one live `rich` panel on stderr; elsewhere (CI logs, pipes) it prints a plain
line when the stage changes, so logs stay readable. `NullProgress` shows nothing (tests).
"""

from __future__ import annotations

import sys
from typing import Any


class NullProgress:
    def update(self, **fields: Any) -> None:
        pass

    def log(self, message: str) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class Progress:
    """Live status of one run; `update(turn=..., stage=..., best=..., cost_usd=...)`."""

    def __init__(self, title: str, *, stream=None, live: bool | None = None):
        from rich.console import Console

        self.console = Console(file=stream or sys.stderr)
        self.title = title
        self.fields: dict[str, Any] = {"turn": 0, "stage": "starting", "attempt": 0, "best": "-"}
        self._live_enabled = self.console.is_terminal if live is None else live
        self._live = None
        self._last_stage = None

    def _render(self):
        from rich.panel import Panel
        from rich.table import Table

        f = self.fields
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        t.add_row("turn", str(f.get("turn", 0)))
        t.add_row("stage", str(f.get("stage", "")))
        t.add_row("attempt", str(f.get("attempt", 0)))
        t.add_row("best so far", str(f.get("best", "-")))
        spent = (f"{f.get('input_tokens', 0)} in / {f.get('output_tokens', 0)} out / "
                 f"{f.get('cache_read_tokens', 0)} cache-read tokens, "
                 f"~${f.get('cost_usd', 0.0):.3f}, {f.get('elapsed_s', 0.0):.0f} s")
        t.add_row("spent", spent)
        return Panel(t, title=self.title, expand=False)

    def update(self, **fields: Any) -> None:
        self.fields.update(fields)
        if self._live is not None:
            self._live.update(self._render())
        elif "stage" in fields and fields["stage"] != self._last_stage:
            self._last_stage = fields["stage"]
            self.console.print(f"[{self.title}] turn {self.fields.get('turn', 0)}: {fields['stage']}",
                               highlight=False, markup=False)

    def log(self, message: str) -> None:
        self.console.print(message, highlight=False, markup=False)

    def __enter__(self):
        if self._live_enabled:
            from rich.live import Live

            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc)
            self._live = None
