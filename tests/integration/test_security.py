"""What a run opens: TLS on every Dask connection when configured (refusing clients without the
certificate), loopback by default with a warning for any other address, and only JSON across
the Lambda boundary."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import logging
import pickle
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from distributed import Client
from distributed.security import Security

from flows.config import ConfigError, load_config
from flows.config.derived import tls_security
from flows.train import main, parse_args, tls_overrides
from flows.training.launch import make_cluster
from resources import cluster as cluster_module
from resources.cluster import start_local_cluster
from resources.lambda_client import LambdaRewardClient
from resources.lambda_emulator import FunctionSpec, LambdaEmulator
from resources.net import is_loopback, warn_if_exposed
from resources.pools import PoolSpec, Role, Tag
from tasks.records import ScoreRequest

POOLS = [PoolSpec(name="env", profile="CPU", role=Role.ENV, workers=1, slots=2)]
TAGS = {"env": [Tag.CPU_ENV]}
EXPOSED = "reachable from other machines"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> dict[str, str]:
    """A CA and a certificate it signed, with the certificate's key, as PEM files (what
    ``dask scheduler --tls-ca-file/--tls-cert/--tls-key`` read)."""
    d = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.UTC)
    valid = {
        "not_valid_before": now - datetime.timedelta(minutes=5),
        "not_valid_after": now + datetime.timedelta(days=1),
    }
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder(
            subject_name=_name("rollarc-test-ca"),
            issuer_name=_name("rollarc-test-ca"),
            public_key=ca_key.public_key(),
            serial_number=1,
            **valid,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder(
            subject_name=_name("rollarc"),
            issuer_name=ca.subject,
            public_key=key.public_key(),
            serial_number=2,
            **valid,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca_file": d / "ca.pem", "cert_file": d / "cert.pem", "key_file": d / "key.pem"}
    files["ca_file"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert_file"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key_file"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return {k: str(v) for k, v in files.items()}


def _tls_overrides(files: dict[str, str]) -> list[str]:
    return [f"cluster.tls.{k}={v}" for k, v in files.items()]


# -- TLS -------------------------------------------------------------------------------------


def test_config_gives_the_security_of_every_role(tls_files):
    sec = tls_security(load_config(overrides=_tls_overrides(tls_files)).cluster.tls)
    assert isinstance(sec, Security) and sec.require_encryption
    assert sec.tls_ca_file == tls_files["ca_file"]
    for role in ("client", "scheduler", "worker"):
        assert getattr(sec, f"tls_{role}_cert") == tls_files["cert_file"]
        assert getattr(sec, f"tls_{role}_key") == tls_files["key_file"]
        assert sec.get_connection_args(role)["ssl_context"] is not None
    assert tls_security(load_config().cluster.tls) is None  # the default: plain TCP
    assert tls_security(load_config(overrides=["cluster.tls=null"]).cluster.tls) is None


def test_cli_flags_fill_the_tls_keys(tls_files):
    args = parse_args(
        [
            "--tls-ca-file",
            tls_files["ca_file"],
            "--tls-cert",
            tls_files["cert_file"],
            "--tls-key",
            tls_files["key_file"],
        ]
    )
    tls = load_config(overrides=tls_overrides(args)).cluster.tls
    assert (tls.ca_file, tls.cert_file, tls.key_file) == (
        tls_files["ca_file"],
        tls_files["cert_file"],
        tls_files["key_file"],
    )
    # quoted: a path YAML would read as something else stays text
    assert tls_overrides(parse_args(["--tls-key", "null"])) == ['cluster.tls.key_file="null"']


@pytest.mark.parametrize("key", ["ca_file", "cert_file", "key_file"])
def test_missing_tls_file_is_a_one_line_error_naming_the_key(tls_files, tmp_path, key):
    missing = str(tmp_path / "absent.pem")
    with pytest.raises(ConfigError) as err:
        load_config(overrides=_tls_overrides(tls_files | {key: missing}))
    msg = str(err.value)
    assert msg.startswith(f"cluster.tls.{key}: no such file") and missing in msg
    assert "\n" not in msg


def test_tls_needs_all_three_files(tls_files):
    with pytest.raises(ConfigError, match=r"^cluster\.tls: key_file is needed with ca_file"):
        load_config(overrides=_tls_overrides(tls_files)[:2])


def test_cli_missing_tls_file_exits_2_naming_the_key(tls_files, tmp_path, capsys):
    missing = str(tmp_path / "absent.pem")
    code = main(
        [
            "--tls-ca-file",
            tls_files["ca_file"],
            "--tls-cert",
            missing,
            "--tls-key",
            tls_files["key_file"],
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"config error: cluster.tls.cert_file: no such file (got {missing!r})"
    assert not (tmp_path / "run").exists()  # nothing started


def _connect(address: str, **kwargs) -> None:
    """Connect a client and close it. Asynchronous: a synchronous Client that failed to
    connect keeps a loop thread whose clean-up at garbage collection can hang."""

    async def attempt() -> None:
        client = Client(address, asynchronous=True, timeout=5, **kwargs)
        try:
            await client
        finally:
            await client.close()  # on failure too: a client left open closes at exit, noisily

    asyncio.run(attempt())


@pytest.mark.integration
def test_tls_cluster_runs_tasks_and_refuses_clients_without_the_certificate(tls_files):
    sec = tls_security(load_config(overrides=_tls_overrides(tls_files)).cluster.tls)
    handle = start_local_cluster(
        POOLS, TAGS, dashboard_port=0, processes=False, timeout=30, security=sec
    )
    try:
        address = handle.cluster.scheduler.address
        assert address.startswith("tls://127.0.0.1:")
        assert all(w.startswith("tls://127.0.0.1:") for w in handle.worker_tags)
        fut = handle.client.submit(lambda x: x + 1, 41, resources={str(Tag.CPU_ENV): 1})
        assert fut.result(timeout=30) == 42
        # no certificate at all: the client cannot even open a TLS connection
        with pytest.raises(TypeError, match="TLS"):
            _connect(address)
        # plain TCP to the TLS port: the handshake fails and the connection is closed
        with pytest.raises(OSError):
            _connect(address.replace("tls://", "tcp://"))
        # a certificate from another CA is refused
        with pytest.raises(OSError):
            _connect(address, security=Security.temporary())
    finally:
        handle.close()


@pytest.mark.integration
def test_make_cluster_and_scheduler_connection_use_the_configured_tls(tls_files):
    cfg = load_config(
        overrides=[
            *_tls_overrides(tls_files),
            "cluster.processes=false",
            "cluster.dashboard_port=0",
        ]
    )
    local = make_cluster(cfg, None)
    try:
        address = local.cluster.scheduler.address
        assert address.startswith("tls://")
        remote = make_cluster(cfg, address)  # what --scheduler tls://... does
        try:
            assert set(remote.worker_tags) == set(local.worker_tags)
        finally:
            remote.client.close()
    finally:
        local.close()


# -- loopback by default ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.2", "localhost", "LOCALHOST", "::1", "[::1]"]
)
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "192.168.0.7", "2001:db8::1"])
def test_exposed_hosts(host, caplog):
    assert not is_loopback(host)
    with caplog.at_level(logging.WARNING, logger="resources.net"):
        assert warn_if_exposed("a server", host)
    assert EXPOSED in caplog.text and repr(host) in caplog.text


def test_defaults_are_loopback():
    cfg = load_config()
    assert cfg.cluster.host == "127.0.0.1" and cfg.reward.emulator.host == "127.0.0.1"


def test_emulator_binds_loopback_by_default_and_warns_otherwise(caplog):
    with caplog.at_level(logging.WARNING, logger="resources.net"):
        with LambdaEmulator([]) as em:
            assert em._server.server_address[0] == "127.0.0.1"
            assert em.url.startswith("http://127.0.0.1:")
        assert EXPOSED not in caplog.text
        # no functions: nothing to run for whoever reaches it while the test binds it
        with LambdaEmulator([], host="0.0.0.0") as em:
            assert em._server.server_address[0] == "0.0.0.0"
    assert (
        f"the Lambda emulation (it runs reward functions for any caller) binds '0.0.0.0': "
        f"it is {EXPOSED}" in caplog.text
    )


@pytest.mark.integration
def test_local_cluster_binds_loopback_by_default(caplog):
    with caplog.at_level(logging.WARNING, logger="resources.net"):
        handle = start_local_cluster(POOLS, TAGS, dashboard_port=0, processes=False, timeout=30)
    try:
        scheduler = handle.cluster.scheduler
        assert scheduler.address.startswith("tcp://127.0.0.1:")
        assert [lst.get_host_port()[0] for lst in scheduler.listeners] == ["127.0.0.1"]
        assert {s.getsockname()[0] for s in scheduler.http_server._sockets.values()} == {
            "127.0.0.1"
        }
        assert handle.dashboard_link.startswith("http://127.0.0.1:")
        assert all(w.startswith("tcp://127.0.0.1:") for w in handle.worker_tags)
    finally:
        handle.close()
    assert EXPOSED not in caplog.text


class _Started(Exception):
    pass


def test_local_cluster_on_every_interface_warns(monkeypatch, caplog):
    """Told 0.0.0.0, the scheduler, dashboard and workers get it, with the warning; the
    cluster is not really started, so nothing here listens beyond this machine."""
    seen = {}

    def spec_cluster(**kwargs):
        seen.update(kwargs)
        raise _Started

    monkeypatch.setattr(cluster_module, "SpecCluster", spec_cluster)
    with caplog.at_level(logging.WARNING, logger="resources.net"), pytest.raises(_Started):
        start_local_cluster(POOLS, TAGS, dashboard_port=0, processes=False, host="0.0.0.0")
    options = seen["scheduler"]["options"]
    assert options["host"] == "0.0.0.0" and options["dashboard_address"] == "0.0.0.0:0"
    assert {w["options"]["host"] for w in seen["workers"].values()} == {"0.0.0.0"}
    assert "the Dask scheduler and dashboard" in caplog.text and EXPOSED in caplog.text


# -- only JSON crosses the Lambda boundary ---------------------------------------------------

RULE = FunctionSpec(
    "rollarc-reward",
    "resources.lambda_handler.lambda_handler",
    30,
    1024,
    {"ROLLARC_REWARD_MODULES": "tasks.rewards"},
)


@pytest.fixture(scope="module")
def emulator():
    with LambdaEmulator([RULE], concurrency=1) as em:
        yield em


def _req(i: int) -> ScoreRequest:
    guess = str(i % 8 + 1)
    return ScoreRequest(
        id=str(i),
        idempotency_key=f"run/{i}/0",
        reward_fn="tasks.rewards.guess_number_verifier",
        env_name="guess_number",
        env_rewards=[1.0 if guess == "3" else 0.0],
        responses=[guess],
        info={"secret": 3, "low": 1, "high": 8, "success": guess == "3", "format_penalty": 0.1},
    )


def test_reward_requests_are_json(emulator):
    client = LambdaRewardClient(
        "rollarc-reward",
        endpoint_url=emulator.url,
        dummy_credentials=True,
        concurrency=1,
        min_batch=1,
    )
    bodies: list[bytes] = []
    client._lambda.meta.events.register(
        "before-send.lambda.Invoke", lambda request, **_: bodies.append(request.body)
    )
    try:
        batch = client.score([_req(i) for i in range(3)])
    finally:
        client.close()
    assert [r.score for r in batch.results] == [0.0, 0.0, 1.0]
    assert bodies
    for body in bodies:
        event = json.loads(body)  # a pickle (b"\x80...") is not JSON
        assert isinstance(event, dict) and body.lstrip().startswith(b"{")


def test_emulator_refuses_a_pickled_body(emulator):
    before = emulator.stats().get("invocations", 0)
    req = urllib.request.Request(
        f"{emulator.url}/2015-03-31/functions/rollarc-reward/invocations",
        data=pickle.dumps({"trajectories": []}),
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    assert err.value.headers["x-amzn-ErrorType"] == "InvalidRequestContentException"
    assert json.loads(err.value.read())["message"] == "Could not parse request body into json"
    assert emulator.stats().get("invocations", 0) == before  # the handler never saw it


def test_tls_file_paths_are_resolved_from_the_working_directory(tls_files, monkeypatch):
    monkeypatch.chdir(Path(tls_files["ca_file"]).parent)
    tls = load_config(
        overrides=_tls_overrides({k: Path(v).name for k, v in tls_files.items()})
    ).cluster.tls
    assert tls.ca_file == "ca.pem" and tls_security(tls) is not None
