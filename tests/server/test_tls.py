"""TLS on both sides: `--ssl` serves HTTPS with LMDeploy's certificate variables (SSL_CERTFILE,
SSL_KEYFILE) whichever edge serves, and `https://` nodes are verified against the system's roots
or `--node-ca-file`, by the data plane and the control plane's own calls alike. Certificates
come from a throwaway CA (trustme)."""

from __future__ import annotations

import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import trustme

from servers import chat_body, free_port, get_json, mock_engine, pdproxy_serve, wait_until

# Against both edges (see the `edge` fixture).
pytestmark = pytest.mark.usefixtures("edge")


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path

    def client(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    directory = tmp_path_factory.mktemp("certs")
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1", "localhost")
    paths = Certs(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    authority.cert_pem.write_to_path(str(paths.ca))
    issued.private_key_pem.write_to_path(str(paths.key))
    with open(paths.cert, "wb") as chain:
        for blob in issued.cert_chain_pems:
            chain.write(blob.bytes())
    return paths


async def test_ssl_serves_https_with_lmdeploys_certificate_variables(
    tmp_path: Path, certs: Certs, http: aiohttp.ClientSession
) -> None:
    lmdeploy_env = {"SSL_CERTFILE": str(certs.cert), "SSL_KEYFILE": str(certs.key)}
    async with (
        mock_engine(tmp_path, "m") as engine,
        pdproxy_serve(tmp_path, "--ssl", "--node", engine.url, env=lmdeploy_env, tls=certs.client()) as proxy,
    ):
        assert proxy.url.startswith("https://")
        async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m"), ssl=certs.client()) as r:
            assert r.status == 200
        async with http.get(proxy.url + "/nodes/status", ssl=certs.client()) as r:  # the control plane's routes too
            assert engine.url in await r.json()
        received = get_json(engine.url + "/mock/requests")[-1]["headers"]
        assert received["x-forwarded-proto"] == "https"
        with pytest.raises(aiohttp.ClientError):
            async with http.get(proxy.url.replace("https://", "http://") + "/health") as r:
                await r.read()


def test_unusable_certificates_are_refused_before_serving(tmp_path: Path, certs: Certs) -> None:
    from servers import EDGE

    missing = tmp_path / "missing.pem"
    for cert, key, named in (
        (missing, certs.key, str(missing)),
        (certs.cert, certs.ca, str(certs.ca)),  # not a key
        (certs.ca, certs.key, str(certs.ca)),  # the key does not match
    ):
        result = subprocess.run(
            [sys.executable, "-m", "pdproxy", "serve", "--edge", EDGE, "--port", str(free_port()), "--ssl"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"SSL_CERTFILE": str(cert), "SSL_KEYFILE": str(key), "PATH": "/usr/bin:/bin"},
        )
        assert result.returncode == 1, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("pdproxy: --ssl")
        assert named in lines[0]


async def test_https_nodes_are_verified_against_the_given_ca(
    tmp_path: Path, certs: Certs, http: aiohttp.ClientSession
) -> None:
    tls_engine = ("--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key))
    async with mock_engine(tmp_path, "m", *tls_engine, tls=certs.client()) as engine:
        assert engine.url.startswith("https://")
        # Added without models: discovery (the control plane's call) reads them over TLS.
        node_ca = ("--node-ca-file", str(certs.ca), "--health-interval", "0.2")
        async with pdproxy_serve(tmp_path, "--node", engine.url, *node_ca) as proxy:
            wait_until(lambda: get_json(proxy.url + "/nodes/status")[engine.url]["models"] == ["m"], 10, "discovery")
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
                assert r.status == 200, await r.text()
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m", stream=True)) as r:
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
            node = get_json(proxy.url + "/nodes/status")[engine.url]
            assert (node["state"], node["health"]["consecutive_failures"]) == ("healthy", 0)
            assert node["succeeded"] == 2
        # The system's roots do not know this CA: the node cannot be verified, nothing reaches it.
        before = len(get_json(engine.url + "/mock/requests", context=certs.client()))
        async with pdproxy_serve(tmp_path, "--node", f"{engine.url},model=m", "--health-interval", "0.2") as proxy:
            async with http.post(proxy.url + "/v1/chat/completions", json=chat_body("m")) as r:
                assert r.status in (502, 503)
            wait_until(lambda: get_json(proxy.url + "/nodes/status")[engine.url]["state"] == "unhealthy", 10, "health")
            error = get_json(proxy.url + "/nodes/status")[engine.url]["health"]["last_error"]
            assert "certificate" in error.lower(), error
        assert len(get_json(engine.url + "/mock/requests", context=certs.client())) == before
