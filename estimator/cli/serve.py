"""``batchfit serve``: the service under uvicorn, HTTPS with a certificate and key checked before it starts.

>>> serve(host="0.0.0.0", port=8443, certfile="tls.crt", keyfile="tls.key")      # doctest: +SKIP
"""

from __future__ import annotations

import re
import ssl

from estimator.errors import MissingExtraError, SpecError


def tls_files(certfile: str | None, keyfile: str | None) -> None:
    """Refuse a TLS setup uvicorn would fail on, as one ``error:`` line rather than its traceback.

    Both files or neither; each readable; and the pair must load as a server's certificate chain and
    private key, checked with the ssl module as uvicorn will load them. An encrypted key is refused: no
    password is taken, and OpenSSL would otherwise prompt for one on the terminal.
    """
    if certfile is None and keyfile is None:
        return
    if certfile is None or keyfile is None:
        given, other = ("--ssl-certfile", "--ssl-keyfile") if keyfile is None else ("--ssl-keyfile", "--ssl-certfile")
        raise SpecError(given, certfile or keyfile, f"{other} FILE with it: HTTPS needs both --ssl-certfile and "
                                                    "--ssl-keyfile")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise SpecError(flag, path, f"a readable PEM file ({exc.strerror})") from exc

    def no_password() -> str:
        raise SpecError("--ssl-keyfile", keyfile, "an unencrypted private key (this one is encrypted; batchfit "
                                                  "serve takes no password)")

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=no_password)
    except ssl.SSLError as exc:
        reason = re.sub(r"\s*\(_ssl\.c:\d+\)$", "", str(exc))  # OpenSSL's source line says nothing to a user
        if "PEM lib" in reason:  # which names neither file: the certificate file holds a certificate, or not
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_verify_locations(cafile=certfile)
                reason += "; --ssl-keyfile holds no PEM private key"
            except ssl.SSLError:
                reason += "; --ssl-certfile holds no PEM certificate"
        raise SpecError("--ssl-certfile/--ssl-keyfile", (certfile, keyfile),
                        f"a PEM certificate chain and the private key that matches it (ssl: {reason})") from exc


def serve(host: str, port: int, certfile: str | None, keyfile: str | None) -> int:
    """Run the service (``app.main:create_app``) until it stops."""
    tls_files(certfile, keyfile)  # before the imports: a bad flag fails fast
    # what the service imports that the core does not install: the service extra
    service_modules = {"uvicorn", "fastapi", "starlette", "pydantic_settings", "prometheus_client", "httpx", "redis",
                       "fastapi_offline"}
    try:
        import uvicorn

        import app.main  # noqa: F401  the service's imports, checked here rather than inside uvicorn
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in service_modules:
            raise  # a defect, not a missing extra
        raise MissingExtraError("service", "batchfit serve", str(exc)) from exc
    uvicorn.run("app.main:create_app", factory=True, host=host, port=port, ssl_certfile=certfile,
                ssl_keyfile=keyfile)
    return 0
