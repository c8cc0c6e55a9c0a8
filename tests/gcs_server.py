"""A Google Cloud Storage server on 127.0.0.1 that both of tpurun's ``gs://`` clients talk to:
gcsfs (every file operation) and TensorFlow's own (``tf.data``, for the ``tf_data`` reader).

gcsfs goes where ``STORAGE_EMULATOR_HOST`` says, in plain HTTP. TF's GCS client has its endpoints
hard-coded (``www.googleapis.com`` for metadata and uploads, ``storage.googleapis.com`` for reads)
and honours ``HTTPS_PROXY``. So the server process runs two things:

- ``gcp-storage-emulator`` (pinned: :data:`EMULATOR`), patched below for both clients' requests, on
  a plain HTTP port that gcsfs and the tests use directly (seeding, reading back, fault controls);
- a CONNECT proxy that terminates TLS with a throwaway CA (``trustme``) whose certificate names
  both hosts, and pipes the decrypted bytes to the emulator.

It runs in a process of its own: TF holds the GIL during an upload, so a server thread in the
process that calls TF deadlocks, and a process can be killed and restarted (its objects are kept
on disk) to simulate an outage.

The patches (each needed for TF 2.21's or gcsfs's requests, or for a fault the tests inject):

1. an upload PUT carries ``Transfer-Encoding: chunked`` *and* ``Content-Length``: the chunked body
   wins (else the object is stored with the chunk framing in it);
2. an empty media upload (TF's directory marker) is accepted, and ``ifGenerationMatch`` is honoured
   on uploads (media, multipart, resumable) and deletes: 412 unless the object's generation is the
   one named (``0``: there is none), as GCS does (the run lock creates its object with ``0``);
3. the resumable-upload URL it returns to TF is ``https://`` (TF reached it over TLS; gcsfs did not);
4. HTTP/1.1 keep-alive with TCP_NODELAY, on a threading server (else ~40 ms a request);
5. ``b/<bucket>/storageLayout``, which TF asks for before renaming a folder;
6. objects stored flat (a hash per name), so a folder marker ``a/`` and an object ``a/b`` coexist;
   no soft delete; one lock around the emulator's (unsynchronised) state;
7. fault controls under ``/_tpurun/``: answer 403 for a bucket, hold uploads whose URL contains a
   text until released.
8. downloads carry ``x-goog-generation`` (TensorStore, Orbax's writer, reads it);
9. the emulator's files are written whole or not at all (a temporary file renamed over the old):
   its state file ``.meta`` is rewritten at every upload, and a kill mid-write (an outage test
   kills the server while uploads are in flight) left it cut short, so the restarted server could
   not read it and exited. GCS itself loses no state in an outage.

Run as a script, it is the server process: ``python gcs_server.py DATA_DIR PEM PORT PROXY_PORT``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

EMULATOR = "gcp-storage-emulator==2026.7.19"  # the version the patches below were written for
HOSTS = ("www.googleapis.com", "storage.googleapis.com")


def _readers():
    """``data.reader`` values a gs:// run is tested with: the native reader (gcsfs reads the
    records) and, where TensorFlow is installed, tf_data (TF's own GCS client reads them)."""
    import importlib.util

    import pytest

    no_tf = importlib.util.find_spec("tensorflow") is None
    skip = pytest.mark.skipif(no_tf, reason="tf_data reads through TensorFlow, not installed")
    return ["native", pytest.param("tf_data", marks=skip)]


# ============================================================================ the server process
def _patch_emulator():
    """Apply the patches of the module docstring; returns the handler class to serve."""
    import hashlib
    from http import HTTPStatus

    from gcp_storage_emulator import server as em
    from gcp_storage_emulator import storage as em_storage
    from gcp_storage_emulator.handlers import objects

    # 1. The chunked body wins over a Content-Length sent beside it.
    original_read = em._read_raw_data

    def read_raw_data(handler):
        if (handler.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            del handler.headers["Content-Length"]
        return original_read(handler)

    em._read_raw_data = read_raw_data

    # 2. Empty media uploads, and generation preconditions (ifGenerationMatch: 0 creates only,
    # another number replaces only that generation) on uploads of every kind and on deletes.
    original_insert, original_delete = objects.insert, objects.delete

    def precondition_failed(request, response, storage, name) -> bool:
        wanted = request.query.get("ifGenerationMatch", [None])[0]
        if wanted is None or name is None:
            return False
        current = storage.objects.get(request.params["bucket_name"], {}).get(name)
        if (current["generation"] if current else "0") == wanted:
            return False
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": "Precondition Failed"}})
        return True

    def uploaded_name(request):
        if "name" in request.query:
            return request.query["name"][0]
        data = request.data if isinstance(request.data, dict) else {}
        return (data.get("meta") or data).get("name")  # multipart: in its metadata part

    def insert(request, response, storage, *args, **kwargs):
        if request.data is None:
            request._data = b""
        if precondition_failed(request, response, storage, uploaded_name(request)):
            return None
        return original_insert(request, response, storage, *args, **kwargs)

    def delete(request, response, storage, *args, **kwargs):
        if precondition_failed(request, response, storage, request.params["object_id"]):
            return None
        return original_delete(request, response, storage, *args, **kwargs)

    # 3. https upload URLs for TF (it came through the TLS proxy, naming a Google host); gcsfs
    # talks plain HTTP to the emulator's own address.
    original_init = em.Request.__init__

    def request_init(self, handler, method):
        original_init(self, handler, method)
        if (handler.headers.get("Host") or "").split(":")[0] not in HOSTS:
            return
        self._base_url = self._base_url.replace("http://", "https://", 1)
        self._full_url = self._base_url + self._path
        self._parsed_url = urllib.parse.urlparse(self._full_url)

    em.Request.__init__ = request_init

    # 5. storageLayout.
    def storage_layout(request, response, storage, *args, **kwargs):
        bucket = request.params["bucket_name"]
        if bucket not in storage.buckets:
            response.status = HTTPStatus.NOT_FOUND
            return
        response.json({"kind": "storage#storageLayout", "bucket": bucket, "location": "US",
                       "locationType": "multi-region",
                       "hierarchicalNamespace": {"enabled": False}})  # fmt: skip

    # 8. Downloads say their generation (x-goog-generation), as GCS's do: TensorStore (Orbax's
    # writer) reads it back to write an object conditionally.
    original_download = objects.download

    def download(request, response, storage, *args, **kwargs):
        params = request.params
        with contextlib.suppress(Exception):  # a missing object: the original answers 404
            obj = storage.get_file_obj(params["bucket_name"], params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
        return original_download(request, response, storage, *args, **kwargs)

    objects.download = download  # `get` with alt=media calls it by this name

    handlers = []
    for pattern, methods in em.HANDLERS:
        methods = dict(methods)
        if methods.get("POST") is objects.insert:
            methods["POST"] = insert
        if methods.get("GET") is original_download:
            methods["GET"] = download
        if methods.get("DELETE") is original_delete:
            methods["DELETE"] = delete
        handlers.append((pattern, methods))
    layout = r"^/storage/v1/b/(?P<bucket_name>[-.\w]+)/storageLayout$"
    em.HANDLERS = ((layout, {"GET": storage_layout}), *handlers)

    # 6. Flat object files; no soft delete.
    def object_path(self, bucket_name, file_name):
        return f"{bucket_name}/{hashlib.sha256(file_name.encode()).hexdigest()}"

    em_storage.Storage._object_path = object_path
    em_storage.Storage._bucket_soft_delete_retention_seconds = lambda self, bucket: 0

    # 9. Whole files only.
    original_write = em_storage._FileStore.write_bytes

    def write_bytes(self, rel: str, content: bytes) -> None:
        if self._use_memory:
            return original_write(self, rel, content)
        temporary = f"{rel}.writing"
        original_write(self, temporary, content)
        os.replace(self._disk_path(temporary), self._disk_path(rel))

    em_storage._FileStore.write_bytes = write_bytes
    return em


class _Faults:
    """What the tests asked the server to do wrong (7)."""

    def __init__(self):
        self.forbidden: set[str] = set()
        self.hold: str | None = None  # uploads whose URL contains this wait for release()
        self.held = 0  # uploads that started waiting
        self.released = threading.Event()


def _bucket_of(path: str) -> str | None:
    parts = [p for p in urllib.parse.urlparse(path).path.split("/") if p]
    for prefix in (["storage", "v1", "b"], ["upload", "storage", "v1", "b"],
                   ["download", "storage", "v1", "b"]):  # fmt: skip
        if parts[: len(prefix)] == prefix:
            return parts[len(prefix)] if len(parts) > len(prefix) else None
    return parts[0] if parts and not parts[0].startswith("_") else None


def _handler_class(em, faults: _Faults):
    from http import server as http_server

    state_lock = threading.Lock()

    class Handler(em.RequestHandler):
        protocol_version = "HTTP/1.1"  # 4.
        disable_nagle_algorithm = True

        def _control(self) -> bool:
            url = urllib.parse.urlparse(self.path)
            if not url.path.startswith("/_tpurun/"):
                return False
            query = urllib.parse.parse_qs(url.query)
            action = url.path.removeprefix("/_tpurun/")
            if action == "forbid":
                faults.forbidden.add(query["bucket"][0])
            elif action == "hold":
                faults.hold, faults.held = query["match"][0], 0
                faults.released.clear()
            elif action == "release":
                faults.hold = None
                faults.released.set()
            body = json.dumps({"held": faults.held}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return True

        def _refuse(self) -> bool:
            bucket = _bucket_of(self.path)
            if bucket not in faults.forbidden:
                return False
            em._read_raw_data(self)  # the body, so that the connection stays in step
            body = json.dumps({"error": {"code": 403, "message": (
                f"tpurun-test@example.iam.gserviceaccount.com does not have storage.objects.get "
                f"access to the Google Cloud Storage bucket {bucket}. Permission "
                "'storage.objects.get' denied on resource (or it may not exist).")}}).encode()  # fmt: skip
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return True

        def _hold(self, method: str) -> None:
            """Hold an upload that names ``faults.hold``: TF's resumable PUTs name the object in
            their URL, gcsfs's one-request (multipart) POSTs in their body."""
            match = faults.hold
            if not (match and method in ("PUT", "POST") and self.path.startswith("/upload/")):
                return
            named = urllib.parse.unquote(self.path)
            if method == "POST" and self.headers.get("Content-Length"):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                self.rfile = _Replay(body, self.rfile)  # the emulator reads it again
                named += body[:4096].decode("utf-8", "replace")
            if match in named:
                faults.held += 1
                faults.released.wait(120)

        def _route(self, method: str) -> None:
            if self._control() or self._refuse():
                return
            self._hold(method)
            with state_lock:  # 6. the emulator's state is not thread-safe
                em.Router(self).handle(method)

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

        def do_PUT(self):
            self._route("PUT")

        def do_DELETE(self):
            self._route("DELETE")

        def do_PATCH(self):
            self._route("PATCH")

    class Server(http_server.ThreadingHTTPServer):
        daemon_threads = True
        allow_reuse_address = True

    return Handler, Server


class _Replay:
    """A request's body, read already, then the connection's own stream (the next requests)."""

    def __init__(self, body: bytes, rest):
        self._body, self._rest = body, rest

    def read(self, size: int = -1) -> bytes:
        if not self._body:
            return self._rest.read(size)
        size = len(self._body) if size is None or size < 0 else size
        out, self._body = self._body[:size], self._body[size:]
        return out

    def readline(self, size: int = -1) -> bytes:
        if not self._body:
            return self._rest.readline(size)
        end = self._body.find(b"\n") + 1 or len(self._body)
        end = end if size is None or size < 0 else min(end, size)
        out, self._body = self._body[:end], self._body[end:]
        return out

    def __getattr__(self, name: str):
        return getattr(self._rest, name)


def _pump(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes; one thread, so the TLS side is never read
    and written at once from two threads."""
    import select
    import ssl

    try:
        while True:
            ready = [a] if isinstance(a, ssl.SSLSocket) and a.pending() else None
            if ready is None:
                ready, _, _ = select.select([a, b], [], [], 300)
                if not ready:
                    return
            for sock in ready:
                data = sock.recv(1 << 16)
                if not data:
                    return
                (b if sock is a else a).sendall(data)
    except OSError:
        return
    finally:
        for sock in (a, b):
            try:
                sock.close()
            except OSError:
                pass


def _proxy(port: int, upstream: int, pem: str) -> socket.socket:
    """The CONNECT proxy: TLS for both Google hosts, ended here, piped to the emulator."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pem)
    listener = socket.create_server(("127.0.0.1", port))

    def serve(conn: socket.socket) -> None:
        head = b""
        try:
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    conn.close()
                    return
                head += chunk
            conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            tls = context.wrap_socket(conn, server_side=True)
            up = socket.create_connection(("127.0.0.1", upstream))
        except OSError:
            conn.close()
            return
        for sock in (tls, up):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _pump(tls, up)

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener


def serve(data_dir: str, pem: str, port: int, proxy_port: int) -> None:
    """The server process: emulator on ``port``, TLS proxy on ``proxy_port``, until killed."""
    import logging

    logging.disable(logging.CRITICAL)  # the emulator logs every 404 as an error
    em = _patch_emulator()
    from gcp_storage_emulator.storage import Storage

    storage = Storage(data_dir=data_dir)
    handler, server_class = _handler_class(em, _Faults())

    def make_handler(*args, **kwargs):
        return handler(storage, *args, **kwargs)

    httpd = server_class(("127.0.0.1", port), make_handler)
    _proxy(proxy_port, port, pem)
    print("READY", flush=True)
    httpd.serve_forever()


# ============================================================================== the test side
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsServer:
    """The server process, seen from the tests: start, kill, restart, and a small client.

    The client talks plain HTTP to the emulator port (no TensorFlow in the test process); the
    code under test reaches it through :attr:`env` in a subprocess.
    """

    def __init__(self, root: Path):
        import trustme

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        cert = ca.issue_cert(*HOSTS)
        self.ca_file = self.root / "ca.pem"
        self.pem_file = self.root / "server.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        cert.private_key_and_cert_chain_pem.write_to_path(str(self.pem_file))
        self.data_dir = self.root / "objects"
        self.port, self.proxy_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    # ------------------------------------------------------------------ the process
    def start(self) -> None:
        log = self.root / "server.log"  # its errors, for a start that fails
        with log.open("ab") as errors:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(self.data_dir), str(self.pem_file), str(self.port),
                 str(self.proxy_port)],
                stdout=subprocess.PIPE, stderr=errors, stdin=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            self.kill()
            said = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the GCS test server did not start: {line!r}\n{said}")

    def kill(self) -> None:
        """End the server at once (SIGKILL): every connection drops, as in an outage."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach this server: gcsfs through ``STORAGE_EMULATOR_HOST``
        (anonymous there, as Google's clients are with an emulator), TF's GCS client through the
        proxy; the retry settings (both clients read them) are lowered to fail fast."""
        proxy = f"http://127.0.0.1:{self.proxy_port}"
        return {
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{self.port}",
            "HTTPS_PROXY": proxy, "https_proxy": proxy,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            "CURL_CA_BUNDLE": str(self.ca_file),
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
            "GCS_RETRY_CONFIG_MAX_RETRIES": "2",
            "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "100000",
            "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US": "500000",
            "GCS_STAT_CACHE_MAX_AGE": "0",
        }  # fmt: skip

    def cli_env(self, *, tpurun_defaults: bool = False, **extra: str) -> dict[str, str]:
        """The environment of a ``tpurun`` subprocess that reaches this server: this process's,
        less what it set for itself (Keras backend, devices, GCS settings), plus :attr:`env`.
        ``tpurun_defaults`` leaves the GCS retry settings to tpurun (slower to fail)."""
        drop = ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS")
        env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("GCS_")}
        env.update(self.env)
        if tpurun_defaults:
            env = {k: v for k, v in env.items() if not k.startswith("GCS_RETRY_CONFIG_")}
        return {**env, "TPURUN_PLAIN": "1", **extra}

    def tpurun(self, *args: str, cwd: Path, wait: bool = True, timeout: float = 300, **env):
        """Run (or, with ``wait=False``, start) the real ``tpurun`` against this server."""
        exe = str(Path(sys.executable).parent / "tpurun")
        proc = subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=cwd, env=self.cli_env(**env))  # fmt: skip
        if not wait:
            return proc
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # ------------------------------------------------------------------ the client
    def _call(self, method: str, path: str, body: bytes | None = None, json_body=None):
        data = json.dumps(json_body).encode() if json_body is not None else body
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, method=method
        )
        if json_body is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    @staticmethod
    def split(gs_path: str) -> tuple[str, str]:
        bucket, _, name = gs_path.removeprefix("gs://").partition("/")
        return bucket, name

    def make_bucket(self, name: str) -> str:
        status, body = self._call("POST", "/storage/v1/b?project=test", json_body={"name": name})
        if status != 200:
            raise RuntimeError(f"cannot create bucket {name}: {status} {body[:200]!r}")
        return f"gs://{name}"

    def put(self, gs_path: str, data: bytes) -> None:
        bucket, name = self.split(gs_path)
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        status, body = self._call("POST", f"/upload/storage/v1/b/{bucket}/o?{query}", data)
        if status != 200:
            raise RuntimeError(f"cannot upload {gs_path}: {status} {body[:200]!r}")

    def upload(self, local: Path, gs_folder: str) -> list[str]:
        """Every file of a local folder (or one file) into ``gs_folder``; returns the paths."""
        local = Path(local)
        files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
        out = []
        for path in files:
            rel = path.relative_to(local).as_posix() if local.is_dir() else path.name
            target = f"{gs_folder.rstrip('/')}/{rel}"
            self.put(target, path.read_bytes())
            out.append(target)
        return out

    def get(self, gs_path: str) -> bytes | None:
        bucket, name = self.split(gs_path)
        quoted = urllib.parse.quote(name, safe="")
        status, body = self._call("GET", f"/storage/v1/b/{bucket}/o/{quoted}?alt=media")
        return body if status == 200 else None

    def metadata(self, gs_path: str) -> dict | None:
        """The object's resource (size, updated, generation...), or None when there is none."""
        bucket, name = self.split(gs_path)
        status, body = self._call(
            "GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}"
        )
        return json.loads(body) if status == 200 else None

    def get_json(self, gs_path: str):
        data = self.get(gs_path)
        return None if data is None else json.loads(data)

    def list(self, gs_prefix: str) -> list[str]:
        """Object names (``gs://`` paths) under a prefix, sorted."""
        bucket, prefix = self.split(gs_prefix)
        query = urllib.parse.urlencode({"prefix": prefix})
        status, body = self._call("GET", f"/storage/v1/b/{bucket}/o?{query}")
        if status != 200:
            return []
        return sorted(f"gs://{bucket}/{item['name']}" for item in json.loads(body)["items"])

    def delete(self, gs_path: str) -> None:
        bucket, name = self.split(gs_path)
        self._call("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")

    # ------------------------------------------------------------------ faults
    def forbid(self, bucket: str) -> None:
        """Answer 403 to every request about this bucket (until the server restarts)."""
        self._call("GET", f"/_tpurun/forbid?bucket={bucket}")

    def hold(self, match: str) -> None:
        """Make uploads whose URL contains ``match`` wait (up to 2 minutes) for :meth:`release`."""
        self._call("GET", f"/_tpurun/hold?{urllib.parse.urlencode({'match': match})}")

    def held(self) -> int:
        return json.loads(self._call("GET", "/_tpurun/state")[1])["held"]

    def release(self) -> None:
        self._call("GET", "/_tpurun/release")

    def wait_for(self, predicate, timeout: float = 60, what: str = "a condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.05)


def __getattr__(name: str):
    """Keras callbacks for training subprocesses (``callbacks.extra``), made on first use so that
    the server process never imports Keras."""
    if name == "SlowBatches":
        import keras

        class SlowBatches(keras.callbacks.Callback):
            """Sleeps after every batch: training that lasts long enough to be interrupted."""

            def __init__(self, seconds: float = 0.05):
                super().__init__()
                self.seconds = seconds

            def on_train_batch_end(self, batch, logs=None):
                time.sleep(self.seconds)

        globals()[name] = SlowBatches
        return SlowBatches
    raise AttributeError(name)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
