"""``kaggle://`` and ``hf://`` presets: downloaded by KerasHub, tried only where the hub answers.

Offline, KerasHub's downloads fail slowly or vaguely: huggingface_hub retries for about 25 s and
KerasHub then reports that the preset "has no config.json"; a network that drops packets can hold
a request much longer. One TCP connection with a short timeout tells first, so the message says
what is wrong and what to do (attach the model on Kaggle and give its folder).

The small JSON files of a handle (its backbone, task and metadata) are fetched with the hub's own
client, as KerasHub fetches them (``get_file`` in keras_hub/src/utils/preset_utils.py), so a
handle is checked as a folder is; its weights come with ``from_preset``.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tpurun.errors import ModelError, describe

CONNECT_TIMEOUT = 3.0  # seconds: a reachable hub answers a TCP connection in well under a second

#: Per handle: the hub's name, the environment variable that moves its endpoint, its default.
HUBS = {
    "kaggle://": ("Kaggle", "KAGGLE_API_ENDPOINT", "https://api.kaggle.com"),
    "hf://": ("Hugging Face", "HF_ENDPOINT", "https://huggingface.co"),
}


def hub_of(handle: str) -> tuple[str, str, int]:
    """(hub name, host, port) a handle is downloaded from."""
    prefix = next(p for p in HUBS if handle.startswith(p))
    name, variable, default = HUBS[prefix]
    url = urlparse(os.environ.get(variable) or default)
    port = url.port or (80 if url.scheme == "http" else 443)
    return name, url.hostname or "", port


def offline_error(handle: str, why: str) -> ModelError:
    """What a handle that cannot be downloaded here is told."""
    name = hub_of(handle)[0]
    return ModelError(
        f"model.preset: {handle} is downloaded from {name}, and {why}. Without a network (a "
        "Kaggle notebook with the internet off, a TPU VM behind a firewall), attach the model as "
        "a Kaggle input (Add Input > Models) and set model.preset to its folder, such as "
        "/kaggle/input/gemma/keras/gemma_2b_en/2; elsewhere, download the preset once where there "
        "is a network and give its folder."
    )


def check_reachable(handle: str, env: Mapping[str, str] | None = None) -> None:
    """Raise at once when the handle's hub cannot be reached from here.

    In a Kaggle notebook, kagglehub serves the models attached to it through Kaggle's own
    service, with the internet off too: a ``kaggle://`` handle is left to it there.

    Raises:
        ModelError: the hub refused or did not answer within :data:`CONNECT_TIMEOUT`.
    """
    env = os.environ if env is None else env
    if handle.startswith("kaggle://") and env.get("KAGGLE_KERNEL_RUN_TYPE"):
        return
    if handle.startswith("hf://") and env.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise offline_error(handle, "HF_HUB_OFFLINE is set")
    _, host, port = hub_of(handle)
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise offline_error(
            handle, f"{host}:{port} cannot be reached from here ({reason})"
        ) from None


def _not_found(exc: BaseException) -> bool:
    """The hub answered that the file does not exist (kagglehub: HTTP 404 or "not present in the
    model files"; huggingface_hub: EntryNotFoundError)."""
    text = str(exc)
    return (
        "EntryNotFound" in type(exc).__name__
        or "404 Client Error" in text
        or "is not present in the model files" in text
    )


def fetch_json(handle: str, name: str) -> dict[str, Any] | None:
    """One JSON file of a handle's preset, downloaded (and cached) by the hub's client; None when
    the preset has no such file.

    Raises:
        ModelError: the client is not installed, the download failed, or the file is not JSON.
    """
    try:
        if handle.startswith("kaggle://"):
            import kagglehub

            path = kagglehub.model_download(handle.removeprefix("kaggle://"), path=name)
        else:
            import huggingface_hub

            repo = handle.removeprefix("hf://")
            path = huggingface_hub.hf_hub_download(repo_id=repo, filename=name)
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except ImportError as exc:
        raise ModelError(
            f"model.preset: {handle} needs the {exc.name} package, which keras-hub installs: "
            "pip install 'tpurun[hub]'."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(
            f"model.preset: {name} of {handle} is not readable JSON ({exc})."
        ) from None
    except Exception as exc:
        if _not_found(exc):
            return None
        if isinstance(exc, OSError) or "Connection" in type(exc).__name__:
            raise offline_error(handle, f"fetching its {name} failed ({describe(exc)})") from None
        raise ModelError(
            f"model.preset: fetching {name} of {handle} failed: {describe(exc)}"
        ) from None
