"""Throwaway certificates for the TLS tests, made at test time with the ``openssl`` command.

A test CA signs a server certificate (SANs ``IP:127.0.0.1`` and ``DNS:localhost``: what a
gateway on loopback verifies) and a client certificate (a gateway's, for mTLS); a second CA signs
a client certificate the first does not trust. P-256 keys: a few milliseconds each, where RSA
keys took seconds on a loaded core. Valid for one day, written under the test's own tmp dir.

The venv has no ``cryptography`` module and the tests add no dependency for this: the ``openssl``
binary is part of any Debian/Ubuntu base image and .ci/run installs it where it is missing. Outside
CI a machine without it skips the TLS tests saying so; in CI (``CI=true``) it fails them, so a CI
that lost the binary cannot pass silently.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl_binary() -> str:
    """The ``openssl`` command, or the skip (outside CI) / failure (in CI) saying it is missing."""
    found = shutil.which("openssl")
    if found:
        return found
    why = "the openssl command is not on PATH (the TLS tests make their certificates with it)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI runs the TLS tests but {why}; .ci/run installs Debian's openssl", pytrace=False)
    pytest.skip(why)


@dataclass(frozen=True)
class Pair:
    """A PEM certificate and its PEM key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    """What :func:`make_pki` wrote."""

    ca: Path
    """The test CA's certificate (what the gateway trusts, and the picker's ``tls_client_ca_file``)."""
    server: Pair
    """The picker's certificate, signed by :attr:`ca` (SANs 127.0.0.1, localhost)."""
    client: Pair
    """A gateway's client certificate, signed by :attr:`ca`."""
    stranger: Pair
    """A client certificate signed by another CA: valid, but not one the picker trusts."""


def _run(binary: str, *args: str) -> None:
    out = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {out.stderr[-2000:]}")


def _ca(binary: str, d: Path, name: str) -> Pair:
    pair = Pair(d / f"{name}.pem", d / f"{name}.key")
    _run(binary, "req", "-x509", *_EC, "-keyout", str(pair.key), "-out", str(pair.cert), "-days", "1",
         "-subj", f"/CN={name}")  # fmt: skip
    return pair


def _signed(binary: str, d: Path, name: str, ca: Pair, extensions: str) -> Pair:
    pair = Pair(d / f"{name}.pem", d / f"{name}.key")
    csr, ext = d / f"{name}.csr", d / f"{name}.ext"
    ext.write_text(extensions + "\nbasicConstraints = critical, CA:FALSE\n")
    _run(binary, "req", "-new", *_EC, "-keyout", str(pair.key), "-out", str(csr), "-subj", f"/CN={name}")
    _run(binary, "x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
         "-set_serial", str(secrets.randbits(63)), "-days", "1", "-extfile", str(ext),
         "-out", str(pair.cert))  # fmt: skip
    return pair


def make_pki(d: Path) -> Pki:
    """A CA, the picker's server certificate, a gateway's client certificate and a stranger's."""
    binary = openssl_binary()
    d.mkdir(parents=True, exist_ok=True)
    ca = _ca(binary, d, "test-ca")
    other = _ca(binary, d, "other-ca")
    serving = "subjectAltName = IP:127.0.0.1, DNS:localhost\nextendedKeyUsage = serverAuth"
    server = _signed(binary, d, "picker", ca, serving)
    client = _signed(binary, d, "gateway", ca, "subjectAltName = DNS:gateway\nextendedKeyUsage = clientAuth")
    stranger = _signed(
        binary, d, "stranger", other, "subjectAltName = DNS:stranger\nextendedKeyUsage = clientAuth"
    )
    return Pki(ca.cert, server, client, stranger)
