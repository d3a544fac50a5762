"""A sandbox for running untrusted Python (a proposed kernel module the build imports).

`Sandbox().command(argv, ...)` wraps a command line in bubblewrap (`bwrap`), a well-kept
namespace sandbox (Debian package `bubblewrap`). The wrapped command runs with:

  * a clean environment: only the variables it is given (never inherited ones, so no API key or
    signing-key path), plus PATH, LANG and HOME=/tmp;
  * no network: a new network namespace with only its own loopback;
  * no view of other processes: a new PID namespace with its own /proc (no other process's
    `environ`, `cmdline` or open files), new IPC and UTS namespaces, and it dies with its parent;
  * a filesystem of read-only system folders (/usr, /bin, /lib*, /etc, and the Python
    interpreter's prefixes) plus the folders it is given: `read` ones read-only, `write` ones
    writable; a private, empty /tmp. Nothing else: not the repository (unless given), not its
    `.git`, not the home folder, not the key store (`.fasttrack/keys`, $FASTTRACK_SIGNING_KEY);
    a key path that lies inside a given folder is hidden under an empty mount;
  * no capabilities, `no_new_privs`, and (where user namespaces are allowed) the unprivileged
    user `nobody`.

What it does not do: it does not limit CPU time, memory or disk use within the writable folders
(the caller's timeout bounds time); it does not hide the system folders (a secret stored under
/etc would be readable); the code can still write anything into the `write` folders, so what
comes back from them is as untrusted as the code; and the kernel it runs on is shared (a kernel
exploit escapes any namespace sandbox).

The command line starts with `env -i`, so bwrap itself (PID 1 inside, its /proc/1/environ
readable there) carries no variable of the caller; do not pass a secret in `env` either, since
the command line of PID 1 (with `--setenv` values) is readable inside too.

`Sandbox.problem()` says why the sandbox cannot run here (None when it can); callers that must
not run untrusted code unsandboxed refuse on it. Nothing here imports the DSL or anything
outside the standard library (the GPU host imports `kernels`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SYSTEM_RO = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
KEY_ENV = "FASTTRACK_SIGNING_KEY"
KEY_DIR = Path(".fasttrack") / "keys"  # relative to a repository root (validation/bundle.py)
NOBODY = 65534
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here; the message says which."""


def _python_roots() -> list[str]:
    """The interpreter's prefixes (a venv and the installation it was made from)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(
        os.path.realpath(sys.executable)))}
    return sorted(r for r in roots if r and os.path.isdir(r))


def _under(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass(frozen=True)
class Sandbox:
    """How to wrap a command; picklable, so a process pool or Ray task can carry it.

    `hidden`: extra paths (files or folders) that must never be visible, on top of the key
    store of `key_roots` (repository roots whose `.fasttrack/keys` is hidden) and
    $FASTTRACK_SIGNING_KEY. `gpu`: also expose the NVIDIA device nodes (for validation on a
    GPU host).
    """

    bwrap: str = "bwrap"
    key_roots: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    gpu: bool = False
    extra_ro: tuple[str, ...] = field(default_factory=tuple)

    def executable(self) -> str | None:
        return shutil.which(self.bwrap)

    def problem(self) -> str | None:
        """Why the sandbox cannot run here (None when a trial command succeeds)."""
        exe = self.executable()
        if exe is None:
            return ("bubblewrap (bwrap) is not installed: `apt-get install -y bubblewrap` "
                    "(.ci/run installs it)")
        try:
            proc = subprocess.run(self.command(["/bin/true"]), capture_output=True, text=True, timeout=30,
                                  env=BASE_ENV)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bubblewrap could not run: {e}"
        if proc.returncode != 0:
            return ("bubblewrap cannot create its namespaces here (user namespaces disabled?): "
                    + (proc.stderr.strip().splitlines() or ["no message"])[-1])
        return None

    def _secret_paths(self) -> list[str]:
        out = [os.path.realpath(h) for h in self.hidden]
        out += [os.path.realpath(Path(r) / KEY_DIR) for r in self.key_roots]
        if os.environ.get(KEY_ENV):
            out.append(os.path.realpath(os.environ[KEY_ENV]))
        return out

    def command(self, argv: list[str], *, env: dict | None = None, read: list = (), write: list = (),
                cwd: str | os.PathLike | None = None) -> list[str]:
        """`argv` wrapped so that it runs sandboxed (see the module docstring).

        `env`: the only variables the command gets (over PATH, LANG, HOME=/tmp). `read` and
        `write`: folders (or files) made visible read-only and writable. `cwd`: its working
        directory (default: the first of `write`, else /tmp).
        """
        exe = self.executable() or self.bwrap
        # bwrap itself starts with an empty environment: it stays visible inside as PID 1 (the
        # namespace's init), and its /proc/1/environ must hold nothing the caller had.
        a = ["/usr/bin/env", "-i", exe, "--unshare-all", "--die-with-parent", "--new-session",
             "--cap-drop", "ALL"]
        if os.geteuid() == 0:
            # As root bwrap needs no user namespace; ask for one anyway so the code runs as nobody.
            a += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
        else:
            a += ["--unshare-user-try"]
        for d in SYSTEM_RO:
            if os.path.lexists(d):
                # /lib and friends are symlinks on merged-/usr systems: recreate the link.
                if os.path.islink(d):
                    a += ["--symlink", os.readlink(d), d]
                else:
                    a += ["--ro-bind", d, d]
        # The private /tmp first: a folder bound after it shows through it, so an interpreter
        # (a venv of a checkout) or a folder that lives under /tmp stays visible.
        a += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        for d in [*_python_roots(), *self.extra_ro]:
            a += ["--ro-bind", d, d]
        if self.gpu:
            for n in sorted(os.listdir("/dev")):
                if n.startswith("nvidia"):
                    a += ["--dev-bind", f"/dev/{n}", f"/dev/{n}"]
            if os.path.isdir("/sys"):
                a += ["--ro-bind", "/sys", "/sys"]
        for p in read:
            p = os.path.realpath(p)
            a += ["--ro-bind", p, p]
        for p in write:
            p = os.path.realpath(p)
            a += ["--bind", p, p]
        # Hide every key path that a bound folder would otherwise show.
        bound = list(SYSTEM_RO) + _python_roots() + list(self.extra_ro) + [os.path.realpath(p) for p in [*read, *write]]
        for s in self._secret_paths():
            if any(_under(s, b) for b in bound) and os.path.lexists(s):
                a += (["--tmpfs", s] if os.path.isdir(s) else ["--ro-bind", "/dev/null", s])
        a += ["--clearenv"]
        for k, v in {**BASE_ENV, **(env or {})}.items():
            a += ["--setenv", k, str(v)]
        first_write = next((os.path.realpath(p) for p in write if os.path.isdir(p)), "/tmp")
        a += ["--chdir", os.path.realpath(cwd) if cwd else first_write, "--", *map(str, argv)]
        return a
