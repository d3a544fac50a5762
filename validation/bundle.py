"""The evidence bundle: one JSON document per change, bound to the cubins it measured (BUNDLE.md).

Schema `fasttrack.evidence/1`. Written atomically (temp file, fsync, os.replace: an interrupted
write leaves the previous complete bundle in place). Signed with Ed25519 over the canonical JSON
of the bundle without its `signature` key; verified against the public keys committed under
`validation/trusted_keys/`.

`cryptography` is imported inside the signing functions only: the GPU host, which lacks it, writes
unsigned bundles, and the runner signs them afterwards with `fasttrack sign`.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .atomic import write_text_atomic

SCHEMA = "fasttrack.evidence/1"
TOOL_VERSION = "0.1.0"
TRUSTED_KEYS_DIR = Path(__file__).with_name("trusted_keys")
DEFAULT_KEY_DIR = Path(".fasttrack") / "keys"  # relative to the repository root; ignored by git
KEY_ENV = "FASTTRACK_SIGNING_KEY"

TOP_LEVEL_KEYS = ("schema", "created", "tool_version", "change", "environment", "binaries",
                  "correctness", "defences", "race", "benchmark", "not_covered", "verdict",
                  "reasons", "signature")
VERDICTS = ("pass", "fail")


# The validator: the code and data that produce a bundle's results (BUNDLE.md, "The validator").
# Every .py and .toml file under these folders (the gate's and the policy's files too: counting
# one file too many costs a re-validation, one too few a false pass) ...
VALIDATOR_TREES = ("validation", "kernels/reference")
VALIDATOR_SUFFIXES = (".py", ".toml")
# ... and the files outside them that the GPU stages import: the oracle, the launcher, the roles,
# the model configuration that sizes inputs, timing and bandwidth ceilings.
VALIDATOR_FILES = ("kernels/reference.py", "kernels/launch.py", "kernels/manifest.py",
                   "kernels/config.py", "benchmarks/common.py")


class BundleError(ValueError):
    """A bundle that cannot be read, is not valid JSON, or does not follow the schema."""


class SigningError(RuntimeError):
    """A bundle cannot be signed: no key, an unreadable key, or no `cryptography`."""


# ---------------------------------------------------------------------------------------------
# Building, checking, reading, writing
# ---------------------------------------------------------------------------------------------


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def json_safe(obj):
    """`obj` with every non-finite float replaced by "nan" / "inf" / "-inf" (JSON has none)."""
    import math

    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def new_bundle(*, change: dict, environment: dict, binaries: list[dict], correctness: dict | None,
               defences: dict | None, race: dict | None, benchmark: dict | None,
               not_covered: list[str], reasons_extra: list[str] | None = None) -> dict:
    """A complete, unsigned bundle; `verdict` is "pass" only if every section present passed, no
    section the verdict needs is missing, and no extra reason was given."""
    reasons = list(reasons_extra or [])
    for name, sec in (("correctness", correctness), ("defences", defences), ("benchmark", benchmark)):
        if sec is None:
            reasons.append(f"{name}: not run")
        elif sec.get("passed") is not True:
            reasons.append(f"{name}: failed")
    if race is not None and race.get("passed") is not True:
        reasons.append("race: failed")
    bundle = {
        "schema": SCHEMA,
        "created": utc_now(),
        "tool_version": TOOL_VERSION,
        "change": change,
        "environment": environment,
        "binaries": binaries,
        "correctness": correctness,
        "defences": defences,
        "race": race,
        "benchmark": benchmark,
        "not_covered": list(not_covered),
        "verdict": "fail" if reasons else "pass",
        "reasons": reasons,
        "signature": None,
    }
    bundle = json_safe(bundle)
    problems = schema_problems(bundle)
    if problems:
        raise BundleError("refusing to build a malformed bundle: " + "; ".join(problems))
    return bundle


def schema_problems(bundle) -> list[str]:
    """What is wrong with `bundle` against schema fasttrack.evidence/1 (empty when it conforms)."""
    if not isinstance(bundle, dict):
        return ["a bundle is a JSON object"]
    p = []
    if bundle.get("schema") != SCHEMA:
        p.append(f"schema is {bundle.get('schema')!r}, expected {SCHEMA!r}")
    for k in TOP_LEVEL_KEYS:
        if k not in bundle:
            p.append(f"missing key {k!r}")
    for k, typ in (("change", dict), ("environment", dict), ("binaries", list), ("not_covered", list),
                   ("reasons", list)):
        if k in bundle and not isinstance(bundle[k], typ):
            p.append(f"{k!r} must be a {typ.__name__}")
    for k in ("correctness", "defences", "race", "benchmark", "signature"):
        if k in bundle and bundle[k] is not None and not isinstance(bundle[k], dict):
            p.append(f"{k!r} must be an object or null")
    if bundle.get("verdict") not in VERDICTS:
        p.append(f"verdict must be one of {VERDICTS}, got {bundle.get('verdict')!r}")
    binaries = bundle.get("binaries")
    for i, b in enumerate(binaries if isinstance(binaries, list) else []):
        if not isinstance(b, dict):
            p.append(f"binaries[{i}] must be an object")
            continue
        missing = [k for k in ("kernel", "side", "variant", "tunables", "build_key", "cubin_sha256") if k not in b]
        if missing:
            p.append(f"binaries[{i}] lacks {', '.join(missing)}")
        if b.get("side") not in ("head", "base"):
            p.append(f"binaries[{i}].side must be 'head' or 'base'")
    return p


# ---------------------------------------------------------------------------------------------
# The validator's fingerprint
# ---------------------------------------------------------------------------------------------


def is_validator_file(relpath: str) -> bool:
    """Whether repo-relative POSIX path `relpath` is one of the validator's source files."""
    if relpath in VALIDATOR_FILES:
        return True
    parts = relpath.split("/")
    return (relpath.endswith(VALIDATOR_SUFFIXES) and "__pycache__" not in parts
            and any(relpath.startswith(top + "/") for top in VALIDATOR_TREES))


def validator_fingerprint(list_files, read_file) -> tuple[str, dict[str, str]]:
    """(validator_sha256, path -> sha256) of the validator's source files in one tree.

    `list_files(folder)` gives the repo-relative paths of the files under a folder (recursively),
    `read_file(path)` a file's bytes or None when it is absent: a checkout on disk
    (`validator_fingerprint_of_tree`) or a git revision (the gate). The digest is the sha256 of
    `sha256sum`'s listing of the files, sorted by path: "<hex>  <path>\n" per file.
    """
    paths = set(VALIDATOR_FILES)
    for top in VALIDATOR_TREES:
        paths.update(list_files(top))
    files = {}
    for rel in sorted(paths):
        if not is_validator_file(rel):
            continue
        data = read_file(rel)
        if data is not None:
            files[rel] = hashlib.sha256(data).hexdigest()
    listing = "".join(f"{digest}  {rel}\n" for rel, digest in sorted(files.items()))
    return hashlib.sha256(listing.encode("utf-8")).hexdigest(), files


def validator_fingerprint_of_tree(root) -> tuple[str, dict[str, str]]:
    """`validator_fingerprint` of the files on disk under checkout `root` (the GPU host's tree:
    no git needed). Untracked files under the validator's folders count: they may run."""
    root = Path(root)

    def list_files(top: str) -> list[str]:
        d = root / top
        return [p.relative_to(root).as_posix() for p in d.rglob("*") if p.is_file()] if d.is_dir() else []

    def read_file(rel: str) -> bytes | None:
        p = root / rel
        return p.read_bytes() if p.is_file() else None

    return validator_fingerprint(list_files, read_file)


def validator_mismatch(bundle: dict, expected_sha256: str, expected_sources: dict[str, str],
                       where: str = "the merge base") -> list[str]:
    """The problem (one line, or none) when `bundle` records a validator other than the expected
    one; it names the files that differ when the bundle recorded its per-file hashes. A bundle
    that records no validator is not judged here (`validator_recorded`)."""
    env = bundle.get("environment") if isinstance(bundle.get("environment"), dict) else {}
    recorded = env.get("validator_sha256")
    if recorded is None or recorded == expected_sha256:
        return []
    detail = ""
    files = env.get("validator_sources_sha256")
    if isinstance(files, dict):
        differ = sorted(p for p in set(files) | set(expected_sources) if files.get(p) != expected_sources.get(p))
        if differ:
            detail = f" ({len(differ)} file(s) differ: {', '.join(map(str, differ[:4]))}{' ...' if len(differ) > 4 else ''})"
    return [f"validated by a different validator: its validator_sha256 {str(recorded)[:16]} is not "
            f"{where}'s {expected_sha256[:16]}{detail}; validate again with {where}'s validator"]


def validator_recorded(bundle: dict) -> bool:
    """Whether `bundle` records the validator that produced it (bundles written before
    `environment.validator_sha256` existed do not)."""
    env = bundle.get("environment")
    return isinstance(env, dict) and env.get("validator_sha256") is not None


def load_bundle(path) -> dict:
    """Read and check a bundle; BundleError with the reason on unreadable, malformed JSON or a
    wrong schema."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise BundleError(f"cannot read bundle {p}: {e.strerror}") from None
    try:
        bundle = json.loads(text)
    except json.JSONDecodeError as e:
        raise BundleError(f"{p}: not valid JSON (line {e.lineno}: {e.msg})") from None
    problems = schema_problems(bundle)
    if problems:
        raise BundleError(f"{p}: not a {SCHEMA} bundle: " + "; ".join(problems[:4]))
    return bundle


def _json_default(o):
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def write_bundle_atomic(path, bundle: dict) -> Path:
    """Write `bundle` to `path` so that readers see the old file or the new one, never a part
    (validation.atomic.write_text_atomic: temporary file, fsync, os.replace)."""
    text = json.dumps(bundle, indent=1, sort_keys=True, default=_json_default, allow_nan=False) + "\n"
    return write_text_atomic(path, text)


# ---------------------------------------------------------------------------------------------
# Signing
# ---------------------------------------------------------------------------------------------


def canonical_json(bundle: dict) -> bytes:
    """The signed bytes: the bundle without `signature`, sorted keys, no whitespace, UTF-8."""
    body = {k: v for k, v in bundle.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=_json_default).encode("utf-8")


def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise SigningError("signing needs the `cryptography` package (pip install cryptography); "
                           "sign on the runner, not the GPU host") from None
    return serialization, ed25519


def key_id(public_key) -> str:
    """sha256 of the raw Ed25519 public key, hex, first 16 characters."""
    serialization, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_key(key_dir, trusted_dir=TRUSTED_KEYS_DIR) -> tuple[Path, Path, str]:
    """A new Ed25519 key pair: private PEM (mode 0600) in `key_dir`, public PEM in `trusted_dir`
    as `<key_id>.pub`. Returns (private path, public path, key_id). Never overwrites a key."""
    serialization, ed25519 = _crypto()
    priv = ed25519.Ed25519PrivateKey.generate()
    kid = key_id(priv.public_key())
    key_dir, trusted_dir = Path(key_dir), Path(trusted_dir)
    key_dir.mkdir(parents=True, exist_ok=True)
    trusted_dir.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = key_dir / f"{kid}.pem", trusted_dir / f"{kid}.pub"
    pem = priv.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_bytes(priv.public_key().public_bytes(serialization.Encoding.PEM,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv_path, pub_path, kid


def _load_private(path):
    serialization, ed25519 = _crypto()
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SigningError(f"cannot read signing key {path}: {e.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise SigningError(f"{path}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SigningError(f"{path}: not an Ed25519 key")
    return key


def sign_bundle(bundle: dict, private_key_path) -> dict:
    """A copy of `bundle` with `signature` = {alg, key_id, value} over its canonical JSON."""
    key = _load_private(private_key_path)
    signed = dict(bundle)
    signed["signature"] = None
    value = key.sign(canonical_json(signed))
    signed["signature"] = {"alg": "ed25519", "key_id": key_id(key.public_key()),
                           "value": base64.b64encode(value).decode("ascii")}
    return signed


@dataclass(frozen=True)
class VerificationResult:
    ok: bool
    key_id: str | None
    reason: str


def verify_bundle(bundle: dict, trusted_keys_dir=TRUSTED_KEYS_DIR) -> VerificationResult:
    """Whether `bundle` is signed by a key in `trusted_keys_dir` and unchanged since signing.

    Never raises on a bad bundle or a stray file among the keys: the reason says what failed.
    """
    sig = bundle.get("signature") if isinstance(bundle, dict) else None
    if not sig:
        return VerificationResult(False, None, "the bundle is not signed")
    if not isinstance(sig, dict) or sig.get("alg") != "ed25519" or not isinstance(sig.get("value"), str):
        return VerificationResult(False, None, "the signature is not an ed25519 signature object")
    kid = sig.get("key_id")
    try:
        serialization, ed25519 = _crypto()
    except SigningError as e:
        return VerificationResult(False, kid, str(e))
    from cryptography.exceptions import InvalidSignature

    for pub in sorted(Path(trusted_keys_dir).glob("*.pub")):
        try:
            key = serialization.load_pem_public_key(pub.read_bytes())
        except (ValueError, OSError):
            continue
        if not isinstance(key, ed25519.Ed25519PublicKey) or key_id(key) != kid:
            continue
        try:
            key.verify(base64.b64decode(sig["value"], validate=True), canonical_json(bundle))
        except (InvalidSignature, ValueError):
            return VerificationResult(False, kid, f"signature by key {kid} does not verify: "
                                                  "the bundle was changed after signing")
        return VerificationResult(True, kid, "")
    return VerificationResult(False, kid, f"key {kid!r} is not among the trusted keys")


def default_private_key(repo_root) -> Path | None:
    """$FASTTRACK_SIGNING_KEY, else the only key in .fasttrack/keys/ of `repo_root`, else None."""
    env = os.environ.get(KEY_ENV)
    if env:
        return Path(env)
    keys = sorted((Path(repo_root) / DEFAULT_KEY_DIR).glob("*.pem"))
    if len(keys) == 1:
        return keys[0]
    return None
