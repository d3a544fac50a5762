"""Trajectories: one JSONL line per event (prompt, model output, tool call and result, timings,
usage) plus the run's config, with every secret redacted before it reaches a file.

Each line is written whole and flushed, so a run stopped by a budget, an error or Ctrl-C leaves a
readable log whose last line is complete. `read_trajectory` loads one back (the replay proposer and
audits use it).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import time
import urllib.parse
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


def _b64_cores(secret: bytes) -> set[str]:
    """The base64 text any copy of `secret` shows inside a longer base64 stream, at each of the
    three byte alignments (standard and URL-safe alphabets): the characters that encode only
    secret bits."""
    out = set()
    for pad in range(3):
        enc = base64.b64encode(b"\0" * pad + secret).decode().rstrip("=")
        first = -(-8 * pad // 6)  # first character holding no padding bit
        last = (8 * (pad + len(secret))) // 6  # characters before this one hold secret bits only
        core = enc[first:last]
        if len(core) >= 8:
            out |= {core, core.replace("+", "-").replace("/", "_")}
    return out


def encodings(secret: str) -> set[str]:
    """The forms of `secret` that must never leave: plain, base64 (any alignment, both alphabets),
    hex (either case), URL-encoded (both quoting styles)."""
    raw = secret.encode()
    forms = {secret, binascii.hexlify(raw).decode(), binascii.hexlify(raw).decode().upper(),
             urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret, safe="")}
    forms |= _b64_cores(raw)
    return {f for f in forms if len(f) >= 8}


def key_file_secrets(text: str) -> list[str]:
    """A PEM key file's secrets: the whole text and each base64 body line (the DER's text)."""
    out = [text.strip()] if text.strip() else []
    body = "".join(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("-----"))
    if body:
        out.append(body)
        try:
            out.append(base64.b64decode(body).decode("latin-1"))
        except (binascii.Error, ValueError):
            pass
    return out


class Redactor:
    """Replaces known secret strings, in every encoding `encodings` lists (and anything shaped like
    an Anthropic key or a PEM private key), with a marker."""

    def __init__(self, secrets: Iterable[str] = (), *, from_env: bool = True):
        found = {s for s in secrets if s}
        if from_env:
            found |= {v for k, v in os.environ.items() if _SECRET_ENV.search(k) and len(v) >= 8}
        self._plain: set[str] = set()
        self._secrets: list[str] = []
        for s in found:
            self.add(s)

    def add(self, secret: str | None) -> None:
        if not secret or secret in self._plain:
            return
        self._plain.add(secret)
        # Longest first, so a secret containing another is replaced whole.
        self._secrets = sorted(set(self._secrets) | encodings(secret), key=len, reverse=True)

    def contains(self, s: str) -> bool:
        """Whether `s` holds a secret in any known form."""
        return any(x in s for x in self._secrets) or bool(_KEY_SHAPES.search(s))

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
