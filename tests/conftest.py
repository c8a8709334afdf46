"""Fill numba's on-disk kernel cache once, before any test.

On a fresh clone nothing is compiled yet (about 35 s of compilation on 2 cores), and the first
process to need a kernel would pay it inside whatever the test measures: a syncer's start-up
deadline, a grace window. A child process does it so that this one starts no OpenMP pool.
"""

import importlib
import subprocess
import sys

import pytest

WARMUP_S_MAX = 600


@pytest.fixture(scope="session", autouse=True)
def _kernels_compiled_on_disk():
    subprocess.run(
        [sys.executable, "-c", "from ddiloco import kernels; kernels.warmup()"], check=True, timeout=WARMUP_S_MAX
    )
    # The kernels' modules (and numba, a second of imports) load on first use (ddiloco.kernels): here,
    # once, rather than inside the first test that merges, whose deadlines would count them. Nothing runs.
    importlib.import_module("ddiloco.kernels._warmup")


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory):
    """One JAX persistent compilation cache for every learner process the tests start: the
    reference model's training step compiles once per session, not once per test (a learner
    process of 10 steps, measured on a loaded 2-core machine: 25 s cold, 14 s warm). No test checks
    compilation itself; each still starts its own processes."""
    return tmp_path_factory.mktemp("jax-cache")


def _self_signed_with_cryptography(cert_path, key_path):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ddiloco test syncer")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _self_signed_with_openssl(cert_path, key_path):
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=ddiloco test syncer",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key_path),
            "-out",
            str(cert_path),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )


@pytest.fixture
def self_signed_cert(tmp_path):
    """(certificate, key): a self-signed certificate for 127.0.0.1 and localhost, made for this test
    (with the `cryptography` package where it is installed, else the `openssl` command)."""
    import importlib.util
    import os

    folder = tmp_path / "tls"
    folder.mkdir()
    cert_path, key_path = folder / "syncer.crt", folder / "syncer.key"
    if importlib.util.find_spec("cryptography") is not None:
        _self_signed_with_cryptography(cert_path, key_path)
    else:
        _self_signed_with_openssl(cert_path, key_path)
    os.chmod(key_path, 0o600)
    return cert_path, key_path
