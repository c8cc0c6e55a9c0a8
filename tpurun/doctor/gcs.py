"""Doctor's GCS probe: in a child process with a timeout (the script
:mod:`tpurun.doctor.scripts.gcs_probe`), reach storage, read the first file of each gs:// data
glob, and write then delete a test object where the config writes.

A bucket that does not exist, a permission error and an unreachable store each get a finding that
names the path and a fix that names the bucket. The child lowers the GCS retries, so a closed
network fails in about 2 s, and is killed at the timeout: doctor never hangs on storage.
"""

from __future__ import annotations

import os
from typing import Any

from tpurun.data.resolve import path_resolver
from tpurun.doctor.check import Check
from tpurun.doctor.child import Child, child_env
from tpurun.errors import TpurunError
from tpurun.storage.fileio import short_detail

# The child's GCS retries: 2, from 100 ms, fail a closed network in about 2 s (tpurun's own
# take about 6 s), well inside the probe's timeout.
GCS_RETRY_ENV = {
    "GCS_RETRY_CONFIG_MAX_RETRIES": "2",
    "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "100000",
}
GCS_PROBE_URL = "gs://cloud-samples-data/README.md"
GCS_ENDPOINT = ("storage.googleapis.com", 443)


def _endpoint(env: dict[str, str]) -> tuple[str, int] | None:
    """Where gcsfs connects first, when not to Google: an emulator (``STORAGE_EMULATOR_HOST``),
    else the HTTPS proxy, if one is set."""
    from urllib.parse import urlparse

    emulator = env.get("STORAGE_EMULATOR_HOST")
    if emulator:
        url = urlparse(emulator if "://" in emulator else f"http://{emulator}")
        default = 443 if url.scheme == "https" else 80
        return (url.hostname, url.port or default) if url.hostname else None
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
    doing = {
        "read": "cannot read the data",
        "write": "cannot write the run directory",
        "url": "cannot reach",
    }[kind]
    error_type = result["error_type"]
    if error_type == "permission":
        role = "roles/storage.objectAdmin" if kind == "write" else "roles/storage.objectViewer"
        return (f"{path}: {doing}: permission denied ({error})",
                f"grant the credentials in use {role} on {bucket} (gcloud storage buckets "
                f"add-iam-policy-binding {bucket} --member=... --role={role}), or set "
                "GOOGLE_APPLICATION_CREDENTIALS to an account that has it")  # fmt: skip
    if error_type == "missing":
        return (f"{path}: {doing}: the bucket {bucket} does not exist",
                f"create it (gcloud storage buckets create {bucket}) or fix the path in the "
                "config")  # fmt: skip
    if error_type == "LookupError":
        return (
            f"{path}: {error}",
            "fix the glob: `tpurun data inspect 'GLOB'` lists what it matches",
        )
    if error_type == "unreachable":
        return (f"{path}: {doing}: storage did not answer ({error})",
                "check the network (and HTTPS_PROXY, if one is needed); on a TPU the data must be "
                "in a bucket the TPU can reach")  # fmt: skip
    return (
        f"{path}: {doing}: {error_type}: {error}",
        f"see the error; {bucket} may be at fault",
    )


class GcsProbe:
    """Started early; :meth:`check` collects it (bounded by its timeout).

    ``endpoint`` is the host and port tried first, before the storage client goes on: the
    emulator or the HTTPS proxy when one is set, else ``storage.googleapis.com:443``. ``targets`` are ``(kind, path)``
    pairs (:func:`gcs_targets`): ``read`` a glob's first file, ``write`` and delete a test object
    in a folder, or ask whether a ``url`` exists.
    """

    def __init__(
        self,
        timeout: float,
        url: str = GCS_PROBE_URL,
        endpoint: tuple[str, int] | None = None,
        targets: list[tuple[str, str]] | None = None,
    ):
        self.timeout = timeout
        self.url = url
        self.targets = targets or [("url", url)]
        if endpoint is None:
            endpoint = _endpoint(dict(os.environ)) or GCS_ENDPOINT
        asked = {"endpoint": list(endpoint), "connect": max(0.5, timeout / 2),
                 "targets": [list(t) for t in self.targets]}  # fmt: skip
        self.child = Child.script("gcs_probe", asked, timeout=timeout, env=child_env(GCS_RETRY_ENV))

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
        fix = (
            "check the network (and HTTPS_PROXY, if one is needed); on a TPU the data must be "
            "in a bucket the TPU can read"
        )
        if result.get("timed_out"):
            return Check(
                "gcs.reachable",
                bad,
                f"GCS did not answer: the probe timed out after {self.timeout:g} s",
                fix,
                result,
            )
        if not result.get("reachable"):
            error = short_detail(str(result.get("error")))
            return Check("gcs.reachable", bad, f"GCS is not reachable: {error}", fix, result)
        failed = [r for r in result.get("results", []) if not r["ok"]]
        if failed:
            problems = [_problem(r) for r in failed]
            return Check(
                "gcs.reachable",
                bad,
                "; ".join(p for p, _ in problems),
                "; ".join(dict.fromkeys(f for _, f in problems)),
                result,
            )
        done = [f"{r['path']}: {r['detail']}" for r in result.get("results", [])]
        if [t[0] for t in self.targets] == ["url"]:
            done = [f"{self.url} {r['detail']}" for r in result.get("results", [])]
        return Check(
            "gcs.reachable",
            "ok",
            f"storage answered in {result['seconds']:.1f} s ({'; '.join(done)})",
            None,
            result,
        )


def start_gcs_probe(timeout: float, cfg: Any = None) -> GcsProbe:
    """The probe for a config (its data and output buckets), or of Google's public bucket."""
    return GcsProbe(timeout, targets=gcs_targets(cfg))


__all__ = [
    "GCS_ENDPOINT", "GCS_PROBE_URL", "GCS_RETRY_ENV", "GcsProbe", "gcs_targets", "start_gcs_probe",
]  # fmt: skip
