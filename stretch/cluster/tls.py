"""Mutual TLS for a cluster's Flight endpoints (nodes and driver) and the clients that call them.

Every party presents ``cert_chain`` (PEM; signed by ``root_certificates``, the cluster's CA) and
accepts a peer only if that CA signed the peer's certificate; the cluster's secret is still
checked on every call. The certificate must name the address peers dial (127.0.0.1 for nodes on
this host: ``subjectAltName = IP:127.0.0.1``; each host's address across hosts). The cluster keeps
the three paths (not the keys) in ``tls.json`` in its directory, so writers in other processes of
the host find them; a caller by the cluster's URL brings its own (``tls=``, or the JSON of a
ClusterTLS in ``$STRETCH_CLUSTER_TLS``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pyarrow import flight

TLS_ENV = "STRETCH_CLUSTER_TLS"  # a node's: the JSON of its ClusterTLS


@dataclass(frozen=True)
class ClusterTLS:
    cert_chain: str  # PEM certificate (chain) this party presents
    private_key: str  # PEM key of that certificate
    root_certificates: str  # PEM of the CA that signs every party's certificate

    def __post_init__(self):
        for name, path in asdict(self).items():
            if not Path(path).is_file():
                raise FileNotFoundError(f"ClusterTLS.{name}: no file {path}")

    def to_json(self) -> str:
        return json.dumps({k: str(Path(v).resolve()) for k, v in asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> ClusterTLS:
        return cls(**json.loads(text))

    @classmethod
    def of_cluster(cls, directory: str | Path) -> ClusterTLS | None:
        """The cluster's TLS settings, None for a cluster without TLS."""
        path = Path(directory) / "tls.json"
        return cls.from_json(path.read_text()) if path.exists() else None

    def _read(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def server_options(self) -> dict:
        """Keyword arguments of a FlightServerBase that requires and verifies client certificates."""
        return {
            "tls_certificates": [
                flight.CertKeyPair(self._read(self.cert_chain), self._read(self.private_key))
            ],
            "verify_client": True,
            "root_certificates": self._read(self.root_certificates),
        }

    def client_options(self) -> dict:
        """Keyword arguments of a FlightClient that verifies the server and presents its own."""
        return {
            "tls_root_certs": self._read(self.root_certificates),
            "cert_chain": self._read(self.cert_chain),
            "private_key": self._read(self.private_key),
        }


def location(host: str, port: int, tls: ClusterTLS | None) -> str:
    return f"{'grpc+tls' if tls is not None else 'grpc'}://{host}:{port}"
