"""Mutual TLS between a cluster's nodes, driver and writers: a cluster with certificates runs and
hands key groups over as without; a caller without a certificate the cluster's CA signed is refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pyarrow import flight

from stretch.cluster import ClusterTLS, StretchCluster
from stretch.cluster.protocol import SECRET_HEADER
from stretch.common.records import to_batch
from tests.cluster.jobs import PAIR, count_sum_job, reference


def _certificates(directory, name: str) -> ClusterTLS:
    """A CA, and a certificate it signs for 127.0.0.1 (openssl, as an operator would make them)."""
    d = directory / name
    d.mkdir()

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        f"/CN={name} CA",
    )
    run(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        "node.key",
        "-out",
        "node.csr",
        "-subj",
        "/CN=node",
    )
    (d / "san.cnf").write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n")
    run(
        "x509",
        "-req",
        "-in",
        "node.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "node.pem",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
    )
    return ClusterTLS(str(d / "node.pem"), str(d / "node.key"), str(d / "ca.pem"))


def test_a_cluster_with_mutual_tls_runs_and_refuses_callers_without_its_certificates(tmp_path):
    tls = _certificates(tmp_path, "cluster")
    stranger = _certificates(tmp_path, "stranger")  # a valid certificate of another CA
    rows = [[(f"k{(b * 13 + i) % 41}", i % 7) for i in range(100)] for b in range(2)]
    with StretchCluster.local(nodes=2, directory=tmp_path / "c", tls=tls) as cluster:
        assert all(loc.startswith("grpc+tls://") for loc in cluster.connection.locations().values())
        client = count_sum_job().execute_async("tls-job", cluster=cluster)
        with client.writer("in") as w:
            w.write(to_batch(rows[0], PAIR), query="q", batch=0)
            cluster.add_node()
            w.write(to_batch(rows[1], PAIR), query="q", batch=1)
        state = {r["key"]: (r["count"], r["sum"]) for r in client.query_state("counts").to_pylist()}
        node = cluster.connection.locations()["node-0"]
        secret = (tmp_path / "c" / "secret").read_text().encode()
        options = flight.FlightCallOptions(headers=[(SECRET_HEADER.encode(), secret)])
        ca = Path(tls.root_certificates).read_bytes()
        for opts in (
            {"tls_root_certs": ca},  # no client certificate
            stranger.client_options() | {"tls_root_certs": ca},
        ):
            with flight.FlightClient(node, **opts) as c, pytest.raises(flight.FlightError):
                list(c.do_action(flight.Action("status", b"{}"), options))
        with flight.FlightClient(node.replace("grpc+tls", "grpc")) as c, pytest.raises(flight.FlightError):
            list(c.do_action(flight.Action("status", b"{}"), options))  # plaintext
        client.cancel()
    assert state == reference([r for b in rows for r in b])
