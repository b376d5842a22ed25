"""The HTTP gateway seen from Python: configuration, durable publish, SSE
with resume, long polls, auth, limits and their metrics, the OpenAPI
document, ``token create``, and ``run``/``close()`` starting and stopping it."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import io
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import fed_helpers
from gateway_helpers import TOKEN, Client, context, gateway_doc, open_gateway
from keyop_messenger import Config, ConfigError, Messenger
from keyop_messenger._prometheus import render
from keyop_messenger.cli import main as cli_main

pki = fed_helpers.pki


def _problems(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        Config.from_dict(doc).validate()
    return err.value.problems


def test_config_errors_name_the_key(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    doc = gateway_doc(pki, tmp_path, listen_addr="", max_body_bytes=0, rate_limit_per_s=-1)
    doc["tls"] = {}
    doc["gateway"]["tokens"].append({"name": "app", "hash": TOKEN})
    problems = _problems(doc)
    text = "\n".join(problems)
    assert "gateway.listen_addr: required when gateway.enabled is true" in text
    assert "tls.cert: required when gateway.enabled is true" in text
    assert "gateway.max_body_bytes: must be > 0, got 0" in text
    assert "gateway.rate_limit_per_s: must be >= 0, got -1" in text
    assert "gateway.tokens[1].name: duplicate token name 'app'" in text
    assert "gateway.tokens[1].hash: must be sha256:" in text
    # A valid section passes.
    Config.from_dict(gateway_doc(pki, tmp_path)).validate()


def test_publish_commits_before_201_and_sse_resumes(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    with open_gateway(pki, tmp_path / "data") as m:
        c = Client(pki, m)
        status, _, one = c.publish("sensors", {"payload_type": "reading", "payload": {"t": 1}})
        assert status == 201, one
        status, _, batch = c.publish(
            "sensors",
            {"messages": [{"payload": {"t": 2}}, {"payload": {"t": 3}}]},
            headers={"Keyop-Payload-Type": "reading"},
        )
        assert status == 201, batch
        ids = one["ids"] + batch["ids"]
        stored = [e.message for e in m.read_channel("sensors")]
        assert [msg.id for msg in stored] == ids
        assert [msg.payload for msg in stored] == [{"t": 1}, {"t": 2}, {"t": 3}]
        assert all(msg.payload_type == "reading" for msg in stored)

        events = c.sse("/v1/channels/sensors/messages?from=earliest", 3)
        assert [e["id"] for _, e in events] == ids
        resumed = c.sse("/v1/channels/sensors/messages", 2, last_event_id=events[0][0])
        assert [e["id"] for _, e in resumed] == ids[1:]
        by_time = c.sse("/v1/channels/sensors/messages?from=2000-01-01T00%3A00%3A00Z", 1)
        assert by_time[0][1]["id"] == ids[0]
        at_offset = c.sse(f"/v1/channels/sensors/messages?from={events[1][0]}", 1)
        assert at_offset[0][1]["id"] == ids[2]
        status, _, err = c.request("GET", "/v1/channels/sensors/messages?from=7",
                                   headers={"Accept": "text/event-stream"})
        assert status == 400 and err["error"] == "invalid", "not a record boundary"

        status, _, poll = c.request(
            "GET", f"/v1/channels/sensors/messages?after={events[1][0]}&limit=5&wait=0.1"
        )
        assert status == 200
        assert [x["message"]["id"] for x in poll["messages"]] == ids[2:]
        assert str(poll["next"]) == events[2][0]
        # Nothing after the end: an empty answer with the same position.
        status, _, empty = c.request("GET", f"/v1/channels/sensors/messages?after={poll['next']}")
        assert status == 200 and empty["messages"] == [] and empty["next"] == poll["next"]

        stats = m.stats().gateway
        assert stats is not None and stats.published == 3


def test_auth_refusals_store_nothing(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    body = {"payload_type": "t", "payload": 1}
    with open_gateway(pki, tmp_path / "data") as m:
        status, headers, err = Client(pki, m, token=None).publish("sensors", body)
        assert status == 401 and err["error"] == "unauthenticated"
        assert headers["www-authenticate"].startswith("Bearer")
        assert Client(pki, m, token="wrong").publish("sensors", body)[0] == 401
        status, _, err = Client(pki, m).publish("other", body)
        assert status == 403 and "other" in err["message"]
        # The certificate of an allowed peer, within and outside its lists.
        node1 = Client(pki, m, cert="node1", token=None)
        assert node1.publish("sensors", body)[0] == 201
        assert node1.publish("other", body)[0] == 403
        # Signed by the CA but not an allowed peer.
        assert Client(pki, m, cert="intruder", token=None).publish("sensors", body)[0] == 403
        assert "other" not in [c.name for c in m.stats().channels]
        assert len(list(m.read_channel("sensors"))) == 1
        gw = m.stats().gateway
        assert gw is not None
        assert gw.refused["unauthenticated"] == 2 and gw.refused["forbidden"] == 3


def test_limits_answer_413_429_503_and_are_exported(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    with open_gateway(
        pki, tmp_path / "data", max_body_bytes=100, rate_limit_per_s=0.01, rate_limit_burst=3,
        max_streams=1,
    ) as m:
        c = Client(pki, m)
        status, _, err = c.publish("big", {"payload_type": "t", "payload": "x" * 200})
        assert status == 413 and err["error"] == "too_large"
        assert "big" not in [ch.name for ch in m.stats().channels]
        # One stream held open by the certificate client; the next is refused.
        holder = Client(pki, m, cert="node1", token=None).connection()
        holder.request("GET", "/v1/channels/sensors/messages",
                       headers={"Accept": "text/event-stream"})
        held = holder.getresponse()
        assert held.status == 200
        status, headers, err = c.request("GET", "/v1/channels/sensors/messages?wait=0")
        assert status == 503 and headers["retry-after"] == "1"
        holder.close()
        statuses = [c.request("GET", "/v1/openapi.json")[0]]
        statuses += [c.publish("sensors", {"payload_type": "t", "payload": 1})[0] for _ in range(3)]
        assert 429 in statuses
        status, headers, err = c.publish("sensors", {"payload_type": "t", "payload": 1})
        assert status == 429 and int(headers["retry-after"]) >= 1
        gw = m.stats().gateway
        assert gw is not None
        assert gw.refused["too_large"] == 1
        assert gw.refused["too_many_streams"] == 1
        assert gw.refused["rate_limited"] >= 2
        text = render(m.stats())
        assert 'keyop_gateway_refused_total{reason="too_large"} 1' in text
        assert 'keyop_gateway_refused_total{reason="too_many_streams"} 1' in text


def test_slow_client_is_disconnected(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    with open_gateway(pki, tmp_path / "data", header_timeout="300ms") as m:
        addr = m.gateway_address
        assert addr is not None
        raw = socket.create_connection(("127.0.0.1", addr[1]), timeout=15)
        with context(pki).wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(b"GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\n")  # never finished
            data = b""
            while chunk := s.recv(4096):  # ends when the server closes (or times out: fails)
                data += chunk
        gw = m.stats().gateway
        assert gw is not None and gw.refused["timed_out"] >= 1


def test_openapi_document_is_valid(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    from openapi_spec_validator import validate
    from openapi_spec_validator.versions import consts  # noqa: F401

    with open_gateway(pki, tmp_path / "data") as m:
        status, _, doc = Client(pki, m, token=None).request("GET", "/v1/openapi.json")
    assert status == 200
    assert doc["openapi"].startswith("3.1")
    validate(doc)
    assert set(doc["paths"]) == {
        "/v1/openapi.json", "/v1/channels/{channel}/messages", "/v1/channels/{channel}/ws",
    }


def test_token_create_prints_a_working_token(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["token", "create", "ci", "--publish", "sensors"]) == 0
    text = out.getvalue()
    token = text.split("token: ", 1)[1].split()[0]
    digest = "sha256:" + hashlib.sha256(token.encode()).hexdigest()
    assert f'hash: "{digest}"' in text
    assert token not in text.split("hash:", 1)[1], "the config snippet holds only the hash"
    entry = {"name": "ci", "hash": digest, "publish": ["sensors"], "subscribe": []}
    with open_gateway(pki, tmp_path / "data", tokens=[entry]) as m:
        c = Client(pki, m, token=token)
        assert c.publish("sensors", {"payload_type": "t", "payload": 1})[0] == 201
        assert c.request("GET", "/v1/channels/sensors/messages")[0] == 403


def test_token_channels_must_be_channel_names(
    pki: fed_helpers.PKI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``token create --publish ../x`` and a gateway.tokens entry listing it
    are refused (the token could never use it); a token with no channel at
    all gets a warning."""
    assert cli_main(["token", "create", "ci", "--publish", "../x"]) == 1
    _, err = capsys.readouterr()
    assert err.startswith("Error: token create: --publish '../x': invalid channel name"), err
    assert cli_main(["token", "create", "idle"]) == 0
    out, err = capsys.readouterr()
    assert "token: " in out and "may do nothing" in err
    entry = {"name": "ci", "hash": "sha256:" + "0" * 64, "publish": ["ok", "../x"],
             "subscribe": ["a b"]}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        open_gateway(pki, tmp_path / "data", tokens=[entry])
    problems = " ".join(info.value.problems)
    assert "gateway.tokens[0].publish[1]: invalid channel name" in problems, problems
    assert "gateway.tokens[0].subscribe[0]: invalid channel name" in problems, problems


def test_close_stops_the_gateway(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    m = open_gateway(pki, tmp_path / "data")
    addr = m.gateway_address
    assert addr is not None
    m.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", addr[1]), timeout=5).close()


def test_plain_http_is_not_served(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    with open_gateway(pki, tmp_path / "data") as m:
        addr = m.gateway_address
        assert addr is not None
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{addr[1]}/v1/openapi.json", timeout=5)


def test_run_serves_the_gateway_until_sigterm(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    from run_helpers import running, write_config

    cfg = write_config(tmp_path / "gw.yaml", gateway_doc(pki, tmp_path / "data"))
    with running(["--config", str(cfg)]) as proc:
        port = int(proc.wait_line(r"gateway: listening on https://127\.0\.0\.1:(\d+)").group(1))
        proc.wait_ready()
        conn = http.client.HTTPSConnection("localhost", port, context=context(pki), timeout=15)
        conn.request(
            "POST", "/v1/channels/sensors/messages",
            body=b'{"payload_type": "t", "payload": {"n": 1}}',
            headers={"Authorization": f"Bearer {TOKEN}"},
        )  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 201, resp.read()
        conn.close()
        assert proc.stop() == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_sighup_replaces_tokens_of_a_running_gateway(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    import signal

    from keyop_messenger.cli.token import token_hash
    from run_helpers import running, write_config

    path = tmp_path / "gw.yaml"
    doc = gateway_doc(pki, tmp_path / "data")
    write_config(path, doc)
    body = b'{"payload_type": "t", "payload": 1}'

    def post(port: int, token: str) -> int:
        conn = http.client.HTTPSConnection("localhost", port, context=context(pki), timeout=15)
        conn.request("POST", "/v1/channels/sensors/messages", body=body,
                     headers={"Authorization": f"Bearer {token}"})
        status = conn.getresponse().status
        conn.close()
        return status

    with running(["--config", str(path)]) as proc:
        port = int(proc.wait_line(r"gateway: listening on https://127\.0\.0\.1:(\d+)").group(1))
        proc.wait_ready()
        assert post(port, TOKEN) == 201
        doc["gateway"]["tokens"] = [
            {"name": "new", "hash": token_hash("new-token"), "publish": ["sensors"]}
        ]
        write_config(path, doc)
        proc.proc.send_signal(signal.SIGHUP)
        proc.wait_line(r"SIGHUP: gateway access reloaded \(1 peers, 1 tokens\)")
        assert post(port, TOKEN) == 401
        assert post(port, "new-token") == 201
        assert proc.stop() == 0


def test_set_gateway_access_revokes_a_token(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    with open_gateway(pki, tmp_path / "data") as m:
        c = Client(pki, m)
        assert c.publish("sensors", {"payload_type": "t", "payload": 1})[0] == 201
        m.set_gateway_access(m.config.hub.allowed_peers, [])
        assert c.publish("sensors", {"payload_type": "t", "payload": 1})[0] == 401
    plain_doc = {"name": "n", "storage": {"data_dir": str(tmp_path / "plain")}}
    plain = Messenger(Config.from_dict(plain_doc))
    with plain, pytest.raises(ConfigError):
        plain.set_gateway_access([], [])


def test_close_ends_open_streams(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    m = open_gateway(pki, tmp_path / "data")
    conn = Client(pki, m).connection()
    try:
        conn.request("GET", "/v1/channels/sensors/messages", headers={
            "Accept": "text/event-stream", "Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"retry: ")
        m.close()
        # The stream ends (a read past the end returns b"", never hangs: the
        # socket has a timeout, which would fail the test).
        while resp.readline():
            pass
    finally:
        conn.close()
        m.close()


def test_refusals_reach_the_metrics_listener(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    doc = gateway_doc(pki, tmp_path / "data")
    doc["metrics"] = {"listen_addr": "127.0.0.1:0"}
    with Messenger(Config.from_dict(doc)) as m:
        assert Client(pki, m, token=None).publish("sensors", {"payload": 1})[0] == 401
        addr = m.metrics_address
        assert addr is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{addr[1]}/metrics", timeout=15) as r:
            text = r.read().decode()
    assert 'keyop_gateway_refused_total{reason="unauthenticated"} 1' in text
    assert "keyop_gateway_requests_total 1" in text


def test_a_long_poll_wait_beyond_any_clock_waits_max_wait(
    pki: fed_helpers.PKI, tmp_path: Path
) -> None:
    # wait=1e300 is a finite number of seconds no clock holds: it waits the
    # gateway's max_wait (the handler panicked on it before).
    with open_gateway(pki, tmp_path / "data", max_wait="300ms") as m:
        c = Client(pki, m)
        assert c.publish("sensors", {"payload_type": "t", "payload": 0})[0] == 201
        end = m.stream_end("sensors")
        status, _, body = c.request("GET", f"/v1/channels/sensors/messages?after={end}&wait=1e300")
        assert status == 200 and body["messages"] == []
        status, _, body = c.request("GET", "/v1/channels/sensors/messages?wait=1e300")
        assert status == 200 and len(body["messages"]) == 1


def test_long_poll_waits_for_the_next_message(pki: fed_helpers.PKI, tmp_path: Path) -> None:
    import threading

    with open_gateway(pki, tmp_path / "data") as m:
        c = Client(pki, m)
        assert c.publish("sensors", {"payload_type": "t", "payload": 0})[0] == 201
        end = m.stream_end("sensors")
        answers: list[Any] = []
        poll = threading.Thread(target=lambda: answers.append(
            c.request("GET", f"/v1/channels/sensors/messages?after={end}&wait=10")))
        poll.start()
        # Published while the poll waits (or before it starts: either way the
        # answer holds exactly this message).
        status, _, published = c.publish("sensors", {"payload_type": "t", "payload": 1})
        assert status == 201
        poll.join(timeout=20)
        assert not poll.is_alive()
        status, _, body = answers[0]
        assert status == 200
        assert [x["message"]["id"] for x in body["messages"]] == published["ids"]
