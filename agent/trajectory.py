"""Trajectories: one JSONL line per event (prompt, model output, tool call and result, timings,
usage) plus the run's config, with every secret redacted before it reaches a file.

Each line is written whole and flushed, so a run stopped by a budget, an error or Ctrl-C leaves a
readable log whose last line is complete. `read_trajectory` loads one back (the replay proposer and
audits use it).
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from validation import atomic

REDACTED = "[REDACTED]"
# Environment variables whose values are treated as secrets wherever they appear.
_SECRET_ENV = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.IGNORECASE)
# Dict keys whose values are dropped whatever they hold.
_SECRET_KEYS = re.compile(r"^(api[_-]?key|x-api-key|authorization|auth[_-]?token|password|secret)$",
                          re.IGNORECASE)
# Shapes of Anthropic keys and PEM private keys (a signing key), in case one arrives by a path we
# did not foresee.
_KEY_SHAPES = re.compile(r"sk-ant-[A-Za-z0-9_\-]{8,}"
                         r"|-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",
                         re.DOTALL)


def scrubbed_environment(env: dict | None = None) -> dict:
    """A copy of `env` (default: this process's) without the variables whose names say they hold
    secrets: what a child process that runs proposed code is given."""
    env = dict(os.environ if env is None else env)
    return {k: v for k, v in env.items() if not _SECRET_ENV.search(k)}


class Redactor:
    """Replaces known secret strings (and anything shaped like an Anthropic key) with a marker."""

    def __init__(self, secrets: Iterable[str] = (), *, from_env: bool = True):
        found = {s for s in secrets if s}
        if from_env:
            found |= {v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= 8}
        # Longest first, so a secret containing another is replaced whole.
        self._secrets = sorted(found, key=len, reverse=True)

    def add(self, secret: str | None) -> None:
        if secret and secret not in self._secrets:
            self._secrets.append(secret)
            self._secrets.sort(key=len, reverse=True)

    def text(self, s: str) -> str:
        for secret in self._secrets:
            if secret in s:
                s = s.replace(secret, REDACTED)
        return _KEY_SHAPES.sub(REDACTED, s)

    def value(self, obj: Any) -> Any:
        """A copy of a JSON-like value with secrets replaced (secret-named keys emptied)."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {
                k: (REDACTED if isinstance(k, str) and _SECRET_KEYS.match(k) and v else self.value(v))
                for k, v in obj.items()
            }
        if isinstance(obj, (list, tuple)):
            return [self.value(v) for v in obj]
        return obj


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):  # SDK (pydantic) objects
        return obj.model_dump(mode="json", exclude_none=True)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def dumps(obj: Any, redactor: Redactor) -> str:
    """JSON text of `obj` with secrets redacted (applied to the serialized text as a last guard)."""
    return redactor.text(json.dumps(redactor.value(json.loads(json.dumps(obj, default=_jsonable))),
                                    ensure_ascii=False, sort_keys=False))


def write_json_atomic(path: Path, obj: Any, redactor: Redactor) -> None:
    """Write redacted JSON to `path` through a temporary file, so readers never see half a file."""
    atomic.write_text_atomic(path, dumps(obj, redactor) + "\n")


def write_text_atomic(path: Path, text: str, redactor: Redactor) -> None:
    """Write `text`, redacted, to `path` through a temporary file."""
    atomic.write_text_atomic(path, redactor.text(text))


class Trajectory:
    """Append-only JSONL log of one run."""

    def __init__(self, path: Path, redactor: Redactor, clock=time.monotonic):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.redactor = redactor
        self._clock = clock
        self._t0 = clock()
        self._seq = 0
        self._fh = open(self.path, "a", encoding="utf-8")

    def event(self, kind: str, **data: Any) -> dict:
        """Append one event; returns the record as written (after redaction)."""
        self._seq += 1
        rec = {
            "seq": self._seq,
            "t": round(self._clock() - self._t0, 4),
            "ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "kind": kind,
            **data,
        }
        line = dumps(rec, self.redactor)
        self._fh.write(line + "\n")
        self._fh.flush()
        return json.loads(line)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()

    def __enter__(self) -> "Trajectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrajectoryError(ValueError):
    """A trajectory file that cannot be read back."""


def read_trajectory(path: Path) -> list[dict]:
    """The events of a trajectory file, in order; a clear error for a missing or malformed file."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TrajectoryError(f"cannot read trajectory {p}: {e.strerror}") from None
    events = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError as e:
            raise TrajectoryError(f"{p.name}:{i}: not a JSON line ({e.msg})") from None
        if not isinstance(ev, dict) or "kind" not in ev:
            raise TrajectoryError(f"{p.name}:{i}: not a trajectory event (no 'kind')")
        events.append(ev)
    if not events:
        raise TrajectoryError(f"{p.name}: empty trajectory")
    return events
