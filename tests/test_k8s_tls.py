"""`batchfit serve --ssl-certfile FILE --ssl-keyfile FILE`: HTTPS, as a Kubernetes admission webhook is served.

The ``tls_service`` fixture starts the real command in a subprocess with a certificate for 127.0.0.1 and
localhost from a throwaway CA (trustme), and yields the HTTPS base URL and the CA's PEM file that a client
trusts; the tests check the handshake, both ways, and that plain HTTP is not answered. The flag rules
(both flags or neither, readable files, a pair that loads) are unit tests of ``estimator.cli.main``: they
fail before uvicorn starts, which they check by making ``uvicorn.run`` fail the test if reached.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import jsonpatch
import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from estimator.cli.main import main

pytestmark = pytest.mark.service

ROOT = Path(__file__).resolve().parents[1]  # the checkout this test file is in: the code the server runs
READY_S = 120.0  # the workers import torch before the service listens


class TLSService(NamedTuple):
    """A running ``batchfit serve`` over HTTPS; unpacks as ``(base_url, ca_pem_path)``."""

    base_url: str
    ca_pem_path: str


class Pem(NamedTuple):
    """PEM files of a server certificate: its chain, its key, and the CA that signed it."""

    cert: Path
    key: Path
    ca: Path


def _issue(folder: Path, ca: trustme.CA | None = None, name: str = "server") -> Pem:
    """A certificate for 127.0.0.1 and localhost, written as PEM files in ``folder``."""
    ca = ca or trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    pem = Pem(folder / f"{name}.crt", folder / f"{name}.key", folder / f"{name}-ca.crt")
    for i, blob in enumerate(cert.cert_chain_pems):
        blob.write_to_path(str(pem.cert), append=i > 0)
    cert.private_key_pem.write_to_path(str(pem.key))
    ca.cert_pem.write_to_path(str(pem.ca))
    return pem


def _verifying(ca_pem_path: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_pem_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (uvicorn shuts down and stops its workers), then SIGKILL to the whole session if it hangs."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker processes too, should any outlive the server
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tls_service(tmp_path_factory) -> Iterator[TLSService]:
    """``batchfit serve`` over HTTPS on a free port of 127.0.0.1, one worker, no cache, no API keys; ready once
    ``GET /healthz`` answers 200 with the CA verified. The server's output goes to ``serve.log`` beside the
    certificates and is shown when it does not come up."""
    folder = tmp_path_factory.mktemp("tls")
    pem = _issue(folder)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFIT_")}  # the service's defaults, not ours
    env.update(BATCHFIT_WORKERS="1", BATCHFIT_CACHE_PATH="",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, "-m", "estimator.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--ssl-certfile", str(pem.cert), "--ssl-keyfile", str(pem.key)]
    log_path = folder / "serve.log"
    with open(log_path, "wb") as log:
        # its own session, so that _stop can kill what it started and nothing else; cwd outside the checkout,
        # so that PYTHONPATH is what finds the code
        proc = subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        with httpx.Client(verify=_verifying(str(pem.ca)), timeout=5) as client:
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"batchfit serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
                try:
                    if client.get(f"{base_url}/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    pytest.fail(f"batchfit serve not answering /healthz after {READY_S:.0f} s:\n"
                                f"{log_path.read_text()[-4000:]}")
                time.sleep(0.5)
        yield TLSService(base_url, str(pem.ca))
    finally:
        _stop(proc)


# --- over TLS ------------------------------------------------------------------------------------------------

def test_healthz_over_tls_with_the_ca_verified(tls_service: TLSService) -> None:
    base_url, ca = tls_service
    assert base_url.startswith("https://")
    with httpx.Client(verify=_verifying(ca), timeout=10) as client:
        r = client.get(f"{base_url}/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert r.url.scheme == "https"


def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(tls_service: TLSService, tmp_path) -> None:
    other_ca = _issue(tmp_path, name="other").ca  # a CA that did not sign the server's certificate
    for verify in (_verifying(str(other_ca)), ssl.create_default_context()):  # another CA; the system's
        with httpx.Client(verify=verify, timeout=10) as client, pytest.raises(httpx.ConnectError) as info:
            client.get(f"{tls_service.base_url}/healthz")
        assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)


def test_plain_http_to_the_tls_port_gets_no_answer(tls_service: TLSService) -> None:
    plain = tls_service.base_url.replace("https://", "http://", 1)
    with httpx.Client(timeout=10) as client:
        try:
            r = client.get(f"{plain}/healthz")
        except httpx.TransportError:
            return  # the server drops a connection that does not start with a TLS handshake
    assert r.status_code != 200, r.text


def test_readyz_over_tls_once_the_worker_is_up(tls_service: TLSService) -> None:
    base_url, ca = tls_service
    deadline = time.monotonic() + READY_S
    with httpx.Client(verify=_verifying(ca), timeout=10) as client:
        while (r := client.get(f"{base_url}/readyz")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["workers"] is True and body["live_workers"] == 1 and body["cache"] == "off"


def test_the_webhook_over_tls(tls_service: TLSService) -> None:
    """The recorded AdmissionReview of a pinned pod, as the API server would POST it: the first answer may come
    at the deadline (unchanged, with a warning) while the estimate runs; a later one carries the patch."""
    base_url, ca = tls_service
    review = json.loads((ROOT / "tests" / "k8s" / "admission_pinned.json").read_text())
    deadline = time.monotonic() + READY_S
    with httpx.Client(verify=_verifying(ca), timeout=30) as client:
        while True:
            r = client.post(f"{base_url}/k8s/mutate", json=review)
            assert r.status_code == 200, r.text
            response = r.json()["response"]
            assert response["uid"] == review["request"]["uid"] and response["allowed"] is True
            if "patch" in response or time.monotonic() > deadline:
                break
            assert response["warnings"] == ["batchfit: not changed: the estimate is still running; it is kept for "
                                            "the next pod with this spec"]
            time.sleep(1)
    ops = json.loads(base64.b64decode(response["patch"]))
    patched = jsonpatch.apply_patch(review["request"]["object"], ops)
    env = {e["name"]: e["value"] for e in patched["spec"]["containers"][0]["env"]}
    assert {"BATCHFIT_BATCH_SIZE", "BATCHFIT_GRAD_ACCUM", "BATCHFIT_MAX_BATCH_SIZE"} <= env.keys()
    assert int(env["BATCHFIT_BATCH_SIZE"]) <= int(env["BATCHFIT_MAX_BATCH_SIZE"])


# --- the flags' rules, checked before uvicorn starts ---------------------------------------------------------

@pytest.fixture()
def no_server(monkeypatch) -> None:
    import uvicorn

    def refuse(*args, **kwargs):
        pytest.fail(f"uvicorn.run reached: {args} {kwargs}")

    monkeypatch.setattr(uvicorn, "run", refuse)


def _serve_error(capsys, *flags: str) -> str:
    """The one stderr line of ``batchfit serve FLAGS``, which must exit 2."""
    assert main(["serve", *flags]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.unit
@pytest.mark.parametrize("given", ["--ssl-certfile", "--ssl-keyfile"])
def test_one_flag_without_the_other(capsys, no_server, tmp_path, given) -> None:
    pem = _issue(tmp_path)
    line = _serve_error(capsys, given, str(pem.cert if given == "--ssl-certfile" else pem.key))
    assert line.startswith(f"error: {given}: got ")
    assert "--ssl-certfile" in line and "--ssl-keyfile" in line


@pytest.mark.unit
@pytest.mark.parametrize("flag", ["--ssl-certfile", "--ssl-keyfile"])
def test_a_missing_or_unreadable_file(capsys, no_server, tmp_path, flag) -> None:
    pem = _issue(tmp_path)
    missing = tmp_path / "nowhere" / "tls.pem"
    files = {"--ssl-certfile": str(pem.cert), "--ssl-keyfile": str(pem.key), flag: str(missing)}
    line = _serve_error(capsys, *(x for kv in files.items() for x in kv))
    assert line.startswith(f"error: {flag}: got {str(missing)!r}") and "No such file or directory" in line
    files[flag] = str(tmp_path)  # a folder: not a file to read
    line = _serve_error(capsys, *(x for kv in files.items() for x in kv))
    assert line.startswith(f"error: {flag}: got {str(tmp_path)!r}") and "readable" in line


@pytest.mark.unit
def test_a_certificate_with_another_certificates_key(capsys, no_server, tmp_path) -> None:
    ca = trustme.CA()
    a, b = _issue(tmp_path, ca, "a"), _issue(tmp_path, ca, "b")
    line = _serve_error(capsys, "--ssl-certfile", str(a.cert), "--ssl-keyfile", str(b.key))
    assert line.startswith("error: --ssl-certfile/--ssl-keyfile: got ")
    assert str(a.cert) in line and str(b.key) in line and "KEY_VALUES_MISMATCH" in line
    assert "_ssl.c" not in line


@pytest.mark.unit
@pytest.mark.parametrize("garbage", ["--ssl-certfile", "--ssl-keyfile", "swapped"])
def test_files_that_are_not_a_certificate_and_key(capsys, no_server, tmp_path, garbage) -> None:
    pem = _issue(tmp_path)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a PEM file\n")
    cert, key = {"--ssl-certfile": (junk, pem.key), "--ssl-keyfile": (pem.cert, junk),
                 "swapped": (pem.key, pem.cert)}[garbage]
    line = _serve_error(capsys, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    assert line.startswith("error: --ssl-certfile/--ssl-keyfile: got ")
    assert str(cert) in line and str(key) in line and "ssl: " in line
    blamed = "--ssl-keyfile holds no PEM private key" if garbage == "--ssl-keyfile" else \
        "--ssl-certfile holds no PEM certificate"
    assert blamed in line


@pytest.mark.unit
def test_an_encrypted_key_is_refused_without_a_prompt(capsys, no_server, tmp_path) -> None:
    pem = _issue(tmp_path)
    key = serialization.load_pem_private_key(pem.key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"secret")))
    line = _serve_error(capsys, "--ssl-certfile", str(pem.cert), "--ssl-keyfile", str(encrypted))
    assert line.startswith(f"error: --ssl-keyfile: got {str(encrypted)!r}") and "encrypted" in line


@pytest.mark.unit
def test_a_good_pair_reaches_uvicorn_with_both_files(monkeypatch, tmp_path) -> None:
    import uvicorn

    pem = _issue(tmp_path)
    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: calls.append((args, kwargs)))
    assert main(["serve", "--port", "8443", "--ssl-certfile", str(pem.cert), "--ssl-keyfile", str(pem.key)]) == 0
    assert main(["serve"]) == 0  # and without the flags, plain HTTP as before
    (args, kwargs), (_, plain) = calls
    assert args == ("app.main:create_app",) and kwargs["factory"] is True and kwargs["port"] == 8443
    assert kwargs["ssl_certfile"] == str(pem.cert) and kwargs["ssl_keyfile"] == str(pem.key)
    assert plain["ssl_certfile"] is None and plain["ssl_keyfile"] is None
