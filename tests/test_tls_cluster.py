"""A cluster across machines, the way docs/deploy.md tells users to secure one: ``dask
scheduler --protocol tls`` and ``dask worker tls://...`` with certificates signed by the user's
own CA, and ``streamrl`` finding its certificate in Dask's config (``DASK_DISTRIBUTED__COMM__TLS__*``).
Real processes on loopback; the certificates are made here with ``cryptography``.

The run trains every sample once over TLS, and the scheduler refuses a client without a
certificate (one line naming what is missing, before Dask's own message blaming the scheduler).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import time
from pathlib import Path

import pytest

from tests.helpers import POOLS, check_every_sample_trained_once, kill_all, read_records, spawn, streamrl

pytestmark = pytest.mark.slow


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA and one certificate it signs (for 127.0.0.1 and localhost), as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject: str, key, issuer_name, issuer_key, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(issuer_name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "streamrl test CA")])
    ca = certificate("streamrl test CA", ca_key, ca_name, ca_key, ca=True)
    leaf = certificate("cluster", key, ca_name, ca_key, ca=False)
    files = {"ca": folder / "ca.pem", "cert": folder / "cluster.pem", "key": folder / "cluster.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return files


def test_a_recipe_runs_on_a_tls_cluster_and_a_client_without_a_certificate_is_one_line(tiny_recipe, tmp_path):
    certs = make_certificates(tmp_path)
    tls = ["--tls-ca-file", str(certs["ca"]), "--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"])]
    procs = {}
    try:
        file = tmp_path / "scheduler.json"
        procs["scheduler"] = spawn(["scheduler", "--host", "127.0.0.1", "--port", "0", "--protocol", "tls",
                                    "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(file), *tls],
                                   tmp_path / "scheduler.log")
        deadline = time.time() + 60
        while not file.exists() or not file.read_text().strip():
            assert procs["scheduler"].poll() is None and time.time() < deadline, (tmp_path / "scheduler.log").read_text()
            time.sleep(0.1)
        time.sleep(0.2)  # (the file is written whole, but give the writer its close)
        address = json.loads(file.read_text())["address"]
        assert address.startswith("tls://127.0.0.1:")
        for pool, threads in POOLS.items():
            procs[pool] = spawn(["worker", address, "--host", "127.0.0.1", "--no-dashboard", "--name", f"{pool}-0",
                                 "--nthreads", str(threads), "--resources", f"{pool}={threads}", *tls],
                                tmp_path / f"{pool}.log")

        # streamrl with no certificate in Dask's config: one line saying what to set
        plain = {k: v for k, v in os.environ.items() if not k.startswith("DASK_DISTRIBUTED__COMM__TLS")}
        refused = streamrl("recipe", "run", str(tiny_recipe), "--plain", "--set", f"cluster.address={address}",
                           env=plain)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        assert "Dask's config gives this process no certificate" in refused.stderr.strip().splitlines()[-1]

        # with it (the environment variables docs/deploy.md names): the run, every sample once
        env = {**plain, "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True",
               "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": str(certs["ca"]),
               "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": str(certs["cert"]),
               "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY": str(certs["key"])}
        proc = streamrl("recipe", "run", str(tiny_recipe), "--plain", "--set", f"cluster.address={address}",
                        "--set", "run.steps=3", "--set", f"run.out_dir={tmp_path / 'tls-runs'}", env=env, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "pools: generate=1, train=1, reward=1" in proc.stderr
        (run_dir,) = (tmp_path / "tls-runs").iterdir()
        records = read_records(run_dir)
        assert [r["step"] for r in records] == [0, 1, 2]
        check_every_sample_trained_once(records)
    finally:
        kill_all(procs)
