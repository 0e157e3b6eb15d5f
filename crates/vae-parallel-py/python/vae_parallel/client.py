"""A client of ``vae-parallel serve`` on numpy arrays or torch tensors, using only the standard
library (``http.client``): no dependency beyond numpy.

``Client(url, token=None)``: ``url`` is ``http://host:port`` or ``unix:/path/to/socket``.
``decode`` and ``encode`` send the array as ``.npy`` and return the service's float32 answer as
the same kind they were given (a torch tensor for a torch tensor), bit-identical to the
in-process ``Vae``; ``decode_frames`` yields a video's frames as the service decodes them;
``decode_to`` writes the answer (``.npy``, ``.png``, ``.gif``, ``.mp4``) to a file as it arrives,
all of it or nothing. The request's options are keywords, the names of the service's JSON
options (``vae_parallel_mode="auto"``, ``latents_normalized=True``, ``output="moments"``).
"""

from __future__ import annotations

import ast
import http.client
import io
import json
import os
import socket
import struct
import tempfile
import urllib.parse
from typing import Any, Iterator

import numpy as np

__all__ = ["Client", "ServiceError"]


class ServiceError(Exception):
    """The service refused or failed a request: ``status`` (HTTP), ``kind`` (the library's error
    kind, e.g. ``invalid_input``) and the one-line message."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(f"{status} {kind}: {message}")
        self.status = status
        self.kind = kind
        self.message = message


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _npy_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return out.getvalue()


def _read_exact(stream, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = stream.read(left)
        if not part:
            raise ServiceError(0, "truncated", "the service's answer ended early (the request failed after it began)")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _read_npy(stream) -> np.ndarray | None:
    """One ``.npy`` array from a stream, or None at its end."""
    magic = stream.read(6)
    if not magic:
        return None
    magic += _read_exact(stream, 6 - len(magic)) if len(magic) < 6 else b""
    if magic != b"\x93NUMPY":
        raise ServiceError(0, "malformed", "the service's answer is not a .npy stream")
    major = _read_exact(stream, 2)[0]
    size = struct.unpack("<H", _read_exact(stream, 2))[0] if major == 1 else struct.unpack("<I", _read_exact(stream, 4))[0]
    header = ast.literal_eval(_read_exact(stream, size).decode("latin1"))
    shape = tuple(header["shape"])
    count = int(np.prod(shape)) if shape else 1
    data = _read_exact(stream, count * np.dtype(header["descr"]).itemsize)
    return np.frombuffer(data, dtype=np.dtype(header["descr"])).reshape(shape).astype(np.float32, copy=False)


def _as_numpy(x: Any) -> tuple[np.ndarray, bool]:
    """The array's values as float32 numpy, and whether it was a torch tensor."""
    if type(x).__module__.startswith("torch"):
        return x.detach().to("cpu").float().numpy(), True
    return np.asarray(x, dtype=np.float32), False


def _like(array: np.ndarray, torch_in: bool) -> Any:
    if torch_in:
        import torch

        return torch.from_numpy(np.array(array))
    return array


class Client:
    """A client of one ``vae-parallel serve`` service."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 600.0):
        self.url = url
        self.token = token
        self.timeout = timeout
        if url.startswith("unix:"):
            self._unix, self._host = url[len("unix:"):], None
        else:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"url must be http://host:port or unix:/path, not {url!r}")
            self._unix, self._host = None, (parts.hostname, parts.port or 80)

    def _connection(self) -> http.client.HTTPConnection:
        if self._unix is not None:
            return _UnixConnection(self._unix, self.timeout)
        return http.client.HTTPConnection(self._host[0], self._host[1], timeout=self.timeout)

    def _request(self, method: str, path: str, body: bytes | None = None, options: dict | None = None):
        """The open response of a request that succeeded (the caller reads and closes it)."""
        headers = {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if options is not None:
            headers["X-VAE-Options"] = json.dumps(options)
        if body is not None:
            headers["Content-Type"] = "application/octet-stream"
        conn = self._connection()
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        if response.status != 200:
            message = response.read().decode("utf-8", "replace").strip()
            kind = response.getheader("X-VAE-Error-Kind", "error")
            conn.close()
            raise ServiceError(response.status, kind, message)
        response._vae_conn = conn  # closed with the response by the caller
        return response

    def _run(self, path: str, x: Any, model: str, options: dict) -> tuple[Any, dict | None]:
        array, torch_in = _as_numpy(x)
        response = self._request("POST", path, _npy_bytes(array), {"model": model, **options})
        try:
            report = response.getheader("X-VAE-Report")
            out = _read_npy(response)
        finally:
            response.close()
            response._vae_conn.close()
        self.last_report = json.loads(report) if report else None
        return _like(out, torch_in)

    def decode(self, latent: Any, model: str, **options: Any) -> Any:
        """Decodes a latent ``[B, C, H, W]`` or ``[B, C, T, H, W]`` into pixels in [-1, 1] on
        the service's model ``model``; the request's report is then ``self.last_report``."""
        return self._run("/v1/decode", latent, model, options)

    def encode(self, image: Any, model: str, **options: Any) -> Any:
        """Encodes pixels in [-1, 1] into a latent (``output="moments"`` for the moments)."""
        return self._run("/v1/encode", image, model, options)

    def decode_frames(self, latent: Any, model: str, **options: Any) -> Iterator[Any]:
        """Decodes a video latent, yielding its frames as the service decodes them: arrays
        ``[B, C, n, H, W]`` that together (concatenated on axis 2) are ``decode``'s answer."""
        array, torch_in = _as_numpy(latent)
        response = self._request("POST", "/v1/decode", _npy_bytes(array), {"model": model, **options, "response": "frames"})
        try:
            while (run := _read_npy(response)) is not None:
                yield _like(run, torch_in)
        finally:
            response.close()
            response._vae_conn.close()

    def decode_to(self, latent: Any, path: str | os.PathLike, model: str, **options: Any) -> str:
        """Decodes a latent into the file ``path`` (``.npy``, ``.png``, ``.gif`` or ``.mp4``, as
        the CLI's ``--out``), copied as it arrives into a temporary sibling renamed at the end: the
        whole file or none. Returns the path."""
        path = os.fspath(path)
        kind = os.path.splitext(path)[1].lower().lstrip(".")
        if kind not in ("npy", "png", "gif", "mp4"):
            raise ValueError(f"{path} must end in .npy, .png, .gif or .mp4")
        array, _ = _as_numpy(latent)
        response = self._request("POST", "/v1/decode", _npy_bytes(array), {"model": model, **options, "response": kind})
        directory = os.path.dirname(os.path.abspath(path))
        fd, staged = tempfile.mkstemp(prefix=".vae-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as out:
                while block := response.read(1 << 20):
                    out.write(block)
            length = response.getheader("Content-Length")
            if length is not None and os.path.getsize(staged) != int(length):
                raise ServiceError(0, "truncated", "the service's answer ended early")
            os.replace(staged, path)
        except BaseException:
            os.unlink(staged)
            raise
        finally:
            response.close()
            response._vae_conn.close()
        return path

    def models(self) -> list[dict]:
        """The service's models: name, class, device, dtype, modes, whether it streams."""
        response = self._request("GET", "/v1/models")
        try:
            return json.loads(response.read())["models"]
        finally:
            response.close()
            response._vae_conn.close()
