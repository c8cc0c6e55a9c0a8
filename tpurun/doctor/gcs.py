"""Doctor's GCS probe: in a child process with a timeout, reach storage, read the first file of
each gs:// data glob, and write then delete a test object where the config writes.

A bucket that does not exist, a permission error and an unreachable store each get a finding that
names the path and a fix that names the bucket. The child lowers TF's GCS retries, so a closed
network fails in about 2 s, and is killed at the timeout: doctor never hangs on storage.
"""

from __future__ import annotations

import os
from typing import Any

from tpurun.doctor import Check
from tpurun.errors import TpurunError
from tpurun.storage.fileio import short_detail

# Lower TF's GCS retries (FIELD-NOTES: 2 retries at 100 ms fail a closed network in ~2 s).
GCS_RETRY_ENV = {
    "GCS_RETRY_CONFIG_MAX_RETRIES": "2",
    "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "100000",
}
GCS_PROBE_URL = "gs://cloud-samples-data/README.md"
GCS_ENDPOINT = ("storage.googleapis.com", 443)


_GCS = """
import json, os, socket, sys, time, uuid
started = time.perf_counter()
def answer(**kw):
    kw["seconds"] = round(time.perf_counter() - started, 3)
    print(__MARK__ + json.dumps(kw)); sys.stdout.flush(); sys.exit(0)
try:
    socket.create_connection(__ENDPOINT__, timeout=__CONNECT__).close()
except OSError as exc:
    answer(reachable=False, stage="connect", error=f"{__ENDPOINT__[0]}:{__ENDPOINT__[1]}: {exc}")
import tensorflow as tf
g = tf.io.gfile
def error_text(exc):
    return (getattr(exc, "message", None) or str(exc)).strip()[:2000] or type(exc).__name__
def url(path):
    return f"exists: {bool(g.exists(path))}"
def read(path):
    files = [f for f in g.glob(path) if not f.endswith("/")]
    if not files:
        raise LookupError(f"no file matches {path}")
    with g.GFile(files[0], "rb") as f:
        f.read(16)
    return f"{len(files)} file(s), the first one read"
def write(folder):
    probe = folder.rstrip("/") + "/.tpurun-doctor-" + uuid.uuid4().hex[:12]
    with g.GFile(probe, "w") as f:
        f.write("written by tpurun doctor to test access; safe to delete\\n")
    g.remove(probe)
    return "a test object written and deleted"
results = []
for kind, path in __TARGETS__:
    t = time.perf_counter()
    try:
        results.append({"kind": kind, "path": path, "ok": True, "detail": globals()[kind](path)})
    except Exception as exc:
        results.append({"kind": kind, "path": path, "ok": False, "error_type": type(exc).__name__,
                        "error": error_text(exc)})
    results[-1]["seconds"] = round(time.perf_counter() - t, 3)
failed = [r for r in results if not r["ok"]]
if results and len(failed) == len(results) and all(r["error_type"] in __UNREACHABLE__ for r in failed):
    answer(reachable=False, stage="gfile", error=failed[0]["error"], results=results)
answer(reachable=True, stage="gfile", results=results)
"""

# TensorFlow's errors when the store cannot be reached at all (its retries spent).
_UNREACHABLE = ("AbortedError", "UnavailableError", "DeadlineExceededError",
                "FailedPreconditionError")  # fmt: skip


def _proxy_endpoint(env: dict[str, str]) -> tuple[str, int] | None:
    """The HTTPS proxy TensorFlow's GCS client (libcurl) goes through, if one is set."""
    from urllib.parse import urlparse

    proxy = env.get("HTTPS_PROXY") or env.get("https_proxy")
    if not proxy:
        return None
    url = urlparse(proxy if "://" in proxy else f"http://{proxy}")
    return (url.hostname, url.port or 1080) if url.hostname else None


def gcs_targets(cfg: Any) -> list[tuple[str, str]]:
    """What the probe does for a config: read the first file of each gs:// data glob, and write
    (then delete) a test object where the config writes: output.dir and a gs:// data.cache."""
    if cfg is None:
        return [("url", GCS_PROBE_URL)]
    from tpurun.data.resolve import path_resolver

    data = cfg.data
    globs: list[str] = []
    for value in (data.train, data.validation):
        globs += [value] if isinstance(value, str) else list(value or [])
    try:
        resolve = path_resolver(cfg)
    except TpurunError:
        resolve = cfg.resolve_path  # data.kaggle_dataset outside Kaggle: the data check says so
    targets = [
        ("read", g) for g in dict.fromkeys(resolve(g) for g in globs) if g.startswith("gs://")
    ]
    folders = [cfg.output.dir] + ([data.cache.rsplit("/", 1)[0]] if data.cache else [])
    targets += [("write", f) for f in dict.fromkeys(folders) if f.startswith("gs://")]
    return targets or [("url", GCS_PROBE_URL)]


def _bucket(path: str) -> str:
    return "gs://" + path.removeprefix("gs://").split("/", 1)[0]


def _problem(result: dict[str, Any]) -> tuple[str, str]:
    """One failed target: what went wrong (naming the path) and the fix (naming the bucket)."""
    kind, path, error = result["kind"], result["path"], short_detail(result["error"])
    bucket = _bucket(path)
    doing = {"read": "cannot read the data", "write": "cannot write the run directory",
             "url": "cannot reach"}[kind]  # fmt: skip
    error_type = result["error_type"]
    if error_type in ("PermissionDeniedError", "UnauthenticatedError"):
        role = "roles/storage.objectAdmin" if kind == "write" else "roles/storage.objectViewer"
        return (f"{path}: {doing}: permission denied ({error})",
                f"grant the credentials in use {role} on {bucket} (gcloud storage buckets "
                f"add-iam-policy-binding {bucket} --member=... --role={role}), or set "
                "GOOGLE_APPLICATION_CREDENTIALS to an account that has it")  # fmt: skip
    if error_type == "NotFoundError":
        return (f"{path}: {doing}: the bucket {bucket} does not exist",
                f"create it (gcloud storage buckets create {bucket}) or fix the path in the "
                "config")  # fmt: skip
    if error_type == "LookupError":
        return (
            f"{path}: {error}",
            "fix the glob: `tpurun data inspect 'GLOB'` lists what it matches",
        )
    if error_type in _UNREACHABLE:
        return (f"{path}: {doing}: storage did not answer ({error})",
                "check the network (and HTTPS_PROXY, if one is needed); on a TPU the data must be "
                "in a bucket the TPU can reach")  # fmt: skip
    return (
        f"{path}: {doing}: {error_type}: {error}",
        f"see the error; {bucket} may be at fault",
    )


class GcsProbe:
    """Started early; :meth:`check` collects it (bounded by its timeout).

    ``endpoint`` is the host and port tried first, before TensorFlow's client goes on: the HTTPS
    proxy when one is set, else ``storage.googleapis.com:443``. ``targets`` are ``(kind, path)``
    pairs (:func:`gcs_targets`): ``read`` a glob's first file, ``write`` and delete a test object
    in a folder, or ask whether a ``url`` exists.
    """

    def __init__(
        self, timeout: float, url: str = GCS_PROBE_URL,
        endpoint: tuple[str, int] | None = None, targets: list[tuple[str, str]] | None = None,
    ):  # fmt: skip
        from tpurun.doctor.probes import Child, _child_env, _code  # probes re-exports this module

        self.timeout = timeout
        self.url = url
        self.targets = targets or [("url", url)]
        if endpoint is None:
            endpoint = _proxy_endpoint(dict(os.environ)) or GCS_ENDPOINT
        code = _code(_GCS, connect=max(0.5, timeout / 2), endpoint=tuple(endpoint),
                     targets=self.targets, unreachable=_UNREACHABLE)  # fmt: skip
        self.child = Child(code, timeout, _child_env(GCS_RETRY_ENV))

    def check(self, uses_gcs: bool | None) -> Check:
        """``uses_gcs``: whether the config reads gs:// paths (None: no config, or it depends on
        the machine); an unreachable GCS fails a config that needs it and warns otherwise."""
        check = self._check(uses_gcs)
        check.seconds = check.data.get("seconds", 0.0)  # the child ran alongside other checks
        return check

    def _check(self, uses_gcs: bool | None) -> Check:
        result = self.child.result()
        result["url"] = self.url
        bad = "fail" if uses_gcs else "warn"
        fix = ("check the network (and HTTPS_PROXY, if one is needed); on a TPU the data must be "
               "in a bucket the TPU can read")  # fmt: skip
        if result.get("timed_out"):
            return Check("gcs.reachable", bad, f"GCS did not answer: the probe timed out after "
                         f"{self.timeout:g} s", fix, result)  # fmt: skip
        if not result.get("reachable"):
            error = short_detail(str(result.get("error")))
            return Check("gcs.reachable", bad, f"GCS is not reachable: {error}", fix, result)
        failed = [r for r in result.get("results", []) if not r["ok"]]
        if failed:
            problems = [_problem(r) for r in failed]
            return Check("gcs.reachable", bad, "; ".join(p for p, _ in problems),
                         "; ".join(dict.fromkeys(f for _, f in problems)), result)  # fmt: skip
        done = [f"{r['path']}: {r['detail']}" for r in result.get("results", [])]
        if [t[0] for t in self.targets] == ["url"]:
            done = [f"{self.url} {r['detail']}" for r in result.get("results", [])]
        return Check("gcs.reachable", "ok", f"storage answered in {result['seconds']:.1f} s "
                     f"({'; '.join(done)})", None, result)  # fmt: skip


def start_gcs_probe(timeout: float, cfg: Any = None) -> GcsProbe:
    """The probe for a config (its data and output buckets), or of Google's public bucket."""
    return GcsProbe(timeout, targets=gcs_targets(cfg))
