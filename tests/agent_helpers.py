"""Shared pieces of the agent tests: a small git repository with a fake kernel, fake build/validate
backends, and a scripted Messages API behind the real `anthropic` client's HTTP transport."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

from agent.backends import FAILED, NO_GPU, OK, UNAVAILABLE, CheckResult

API_KEY = "sk-ant-api03-TESTKEY-do-not-leak-0123456789abcdef"

TOY_SOURCE = '''\
"""A toy op standing in for a CuTe DSL kernel in the agent tests."""

TUNABLES = ("threads", "unroll")  # their defaults: the manifest's [kernels.toy.tunables]


def kernel(x):
    acc = 0
    for v in x:
        acc += v
    return acc
'''

MANIFEST = '''\
[kernels.toy]
description = "toy reduction"
op = "kernels.ops.toy:ToyOp"
reference = "kernels.reference:toy"
sources = ["kernels/ops/toy.py"]
params = [
  { name = "x", role = "activation" },
  { name = "w", role = "static" },
  { name = "y", role = "activation", direction = "out" },
]
[kernels.toy.tunables]
threads = { choices = [64, 128, 256], default = 128 }
unroll = { choices = [1, 2, 4], default = 2 }
[kernels.toy.shapes]
batch = [1, 8, 64]
problems = [{ n = 256 }, { n = 1024 }]

[kernels.other]
description = "another kernel"
op = "kernels.ops.other:OtherOp"
reference = "kernels.reference:other"
sources = ["kernels/ops/other.py"]
params = [{ name = "x", role = "activation" }]
[kernels.other.shapes]
batch = [1]
'''


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def make_repo(root: Path) -> Path:
    """A git repository with kernels/manifest.toml, a toy kernel and a reference, one commit."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "kernels" / "ops").mkdir(parents=True)
    (root / "kernels" / "manifest.toml").write_text(MANIFEST)
    (root / "kernels" / "ops" / "toy.py").write_text(TOY_SOURCE)
    (root / "kernels" / "ops" / "other.py").write_text("X = 1\n")
    (root / "kernels" / "reference.py").write_text("def toy(x):\n    return sum(x)\n")
    (root / ".gitignore").write_text("/.fasttrack/\n/build/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "Test")
    git(root, "config", "user.email", "test@example.invalid")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    return root


class FakeBackends:
    """Build = Python compile of the toy source; audit flags 'ld.global.nc'; no GPU by default."""

    def __init__(self, *, gpu: bool = False, validate_status: str | None = None):
        self.gpu = gpu
        self.validate_status = validate_status
        self.calls: list[tuple] = []

    def gpu_available(self) -> bool:
        return self.gpu

    def sandbox_problem(self):
        return None

    def build(self, root, kernel, shapes=None, tunables=None) -> CheckResult:
        self.calls.append(("build", kernel, None if shapes is None else len(shapes), tunables))
        src = (Path(root) / "kernels" / "ops" / f"{kernel}.py").read_text()
        try:
            compile(src, f"kernels/ops/{kernel}.py", "exec")
        except SyntaxError as e:
            return CheckResult("build", FAILED, f"BuildError: {kernel}: kernels/ops/{kernel}.py:{e.lineno}: {e.msg}")
        n = 6 if shapes is None else len(shapes)
        # The "code": the source without comments and the manifest (defaults), as a cubin's code
        # hash ignores line tables; the bytes hash also covers the comments.
        manifest = (Path(root) / "kernels" / "manifest.toml").read_text()
        lines = [re.sub(r"#.*", "", line).rstrip() for line in src.splitlines()]
        code = "\n".join(x for x in lines if x.strip()) + manifest + json.dumps(tunables, sort_keys=True)
        built = [{"variant": {"batch": i}, "resources": {"registers": 32},
                  "cubin_sha256": hashlib.sha256(f"{i}{src}{code}".encode()).hexdigest(),
                  "cubin_code_sha256": hashlib.sha256(f"{i}{code}".encode()).hexdigest()}
                 for i in range(n)]
        return CheckResult("build", OK, f"built {n} variants", {"built": built})

    def audit(self, root, kernel) -> CheckResult:
        self.calls.append(("audit", kernel))
        src = (Path(root) / "kernels" / "ops" / f"{kernel}.py").read_text()
        if "ld.global.nc" in src:
            return CheckResult("audit", FAILED, "NC_ON_ACTIVATION: non-coherent load of activation x")
        return CheckResult("audit", OK, "clean")

    def validate(self, root, kernel, out_dir, base=None) -> CheckResult:
        self.calls.append(("validate", kernel, base))
        if not self.gpu:
            return CheckResult("validate", NO_GPU, "no CUDA device on this host: not run")
        if self.validate_status == FAILED:
            return CheckResult("validate", FAILED, "numerics: max abs error 3.2 above tolerance")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bundle.json").write_text(json.dumps({"schema": "fasttrack.evidence/1", "verdict": "pass"}))
        (out / "report.html").write_text("<html>report</html>")
        return CheckResult("validate", OK, "pass", {"bundle": str(out / "bundle.json")})

    def benchmark(self, root, kernel, out_dir, base=None) -> CheckResult:
        self.calls.append(("benchmark", kernel, base))
        if not self.gpu:
            return CheckResult("benchmark", NO_GPU, "no CUDA device on this host: no benchmark was run")
        return CheckResult("benchmark", UNAVAILABLE, "not wired")


# -- the scripted Messages API ---------------------------------------------------------------

def usage(inp=100, out=50, cache_read=0, cache_write=0) -> dict:
    return {"input_tokens": inp, "output_tokens": out, "cache_read_input_tokens": cache_read,
            "cache_creation_input_tokens": cache_write}


def message(content: list[dict], stop_reason: str = "tool_use", *, u: dict | None = None, n: int = 0) -> dict:
    return {"id": f"msg_{n:04d}", "type": "message", "role": "assistant", "model": "claude-opus-5-5",
            "content": content, "stop_reason": stop_reason, "stop_sequence": None, "usage": u or usage()}


def tool_use(name: str, inp: dict, tid: str) -> dict:
    return {"type": "tool_use", "id": tid, "name": name, "input": inp}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def error_response(status: int, etype: str, msg: str = "try later", headers: dict | None = None):
    return (status, {"type": "error", "error": {"type": etype, "message": msg}}, headers or {})


class ScriptedAPI:
    """An httpx2 MockTransport handler answering /v1/messages from a script, recording requests."""

    def __init__(self, script: list):
        self.script = list(script)
        self.requests: list[dict] = []
        self.headers: list[dict] = []

    def __call__(self, request):
        import httpx2

        self.requests.append(json.loads(request.content.decode()))
        self.headers.append(dict(request.headers))
        if not self.script:
            return httpx2.Response(500, json={"type": "error", "error": {"type": "api_error",
                                                                         "message": "script exhausted"}})
        item = self.script.pop(0)
        if isinstance(item, tuple):
            status, body, headers = item
            return httpx2.Response(status, json=body, headers=headers)
        return httpx2.Response(200, json=item)

    def client(self):
        import httpx2

        return httpx2.Client(transport=httpx2.MockTransport(self))


def all_written_text(*roots: Path) -> str:
    """The text of every file under `roots` (binary files decoded loosely), for leak checks."""
    out = []
    for root in roots:
        for p in Path(root).rglob("*"):
            if p.is_file():
                out.append(p.read_bytes().decode("utf-8", "replace"))
    return "\n".join(out)


# -- a scripted Messages API on a real socket (127.0.0.1) --------------------------------------

HANG = "hang"  # a script item: the server holds the request open until the test ends


class LoopbackAPI:
    """A Messages API on 127.0.0.1 (http.server in a thread) answering POST /v1/messages from a
    script: a dict is a 200 JSON message, a (status, body, headers) tuple an error, bytes a raw
    (malformed) 200 body, HANG a request that never answers. Point the real SDK at it with
    ANTHROPIC_BASE_URL=api.url. Records each request's JSON and headers."""

    def __init__(self, script: list):
        import http.server
        import threading

        self.script = list(script)
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.release = threading.Event()
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n)
                api.headers.append({k.lower(): v for k, v in self.headers.items()})
                try:
                    api.requests.append(json.loads(body))
                except ValueError:
                    api.requests.append({})
                item = api.script.pop(0) if api.script else (500, {"type": "error", "error": {
                    "type": "api_error", "message": "script exhausted"}}, {})
                if item == HANG:
                    api.release.wait(120)
                    return
                status, headers = 200, {}
                if isinstance(item, tuple):
                    status, item, headers = item
                data = item if isinstance(item, bytes) else json.dumps(item).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


# -- the real sandbox around a toy build -------------------------------------------------------

class SandboxedToyBackends(FakeBackends):
    """FakeBackends whose build really imports the worktree's toy kernel, in the real sandbox
    (kernels/sandbox.py), as kernels/build.py's compile children do: the worktree read-only, one
    output folder (`out`) writable, given to the code as $FASTTRACK_OUT."""

    def __init__(self, out: Path, sandbox, **kw):
        super().__init__(**kw)
        self.out = Path(out)
        self.sandbox = sandbox
        self.runs: list = []

    def sandbox_problem(self):
        return self.sandbox.problem()

    def build(self, root, kernel, shapes=None, tunables=None) -> CheckResult:
        import sys

        self.out.mkdir(parents=True, exist_ok=True)
        root = Path(root).resolve()
        code = ("import sys; sys.path.insert(0, sys.argv[1]); sys.dont_write_bytecode = True; "
                f"import kernels.ops.{kernel}")
        cmd = self.sandbox.command([sys.executable, "-I", "-c", code, str(root)],
                                   env={"FASTTRACK_OUT": str(self.out)}, read=[root], write=[self.out])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        self.runs.append(proc)
        if proc.returncode != 0:
            return CheckResult("build", FAILED, f"BuildError: {kernel}: {proc.stderr.strip()[-1500:]}")
        return super().build(root, kernel, shapes, tunables)
