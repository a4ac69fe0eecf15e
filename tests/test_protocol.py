"""Wire protocol codecs and addresses (unit)."""
import msgspec
import pytest

from dispatcher.common.addresses import Endpoints
from dispatcher.common import protocol as P


def test_message_round_trip():
    job = P.WorkerJob(id="cmpl-1", model="m", prompt="é",
                      generation=P.Generation(max_tokens=3))
    msg = P.decode(P.encode(P.SUBMIT, "cmpl-1", job))
    assert (msg.cmd, msg.request_id) == (P.SUBMIT, "cmpl-1")
    assert (msg.body.id, msg.body.model, msg.body.prompt) == ("cmpl-1", "m", "é")
    # the dispatcher holds the generation unparsed; a worker reads it typed
    assert msg.body.generation == msgspec.Raw(b'{"max_tokens":3}')
    assert P.decode(P.encode(P.REQUEST, "cmpl-1", msg.body)).body == job


def test_a_body_that_is_not_its_commands_struct_is_a_protocol_error():
    with pytest.raises(P.ProtocolError, match="SUBMIT body"):
        P.decode(P.encode(P.SUBMIT, "cmpl-1", {"model": "m", "prompt": "é"}))   # no id
    with pytest.raises(P.ProtocolError, match="DONE body"):
        P.decode(P.encode(P.DONE, "cmpl-1", {"attempt": "two"}))


def test_empty_body_is_an_empty_frame():
    assert P.encode(P.PING)[3] == b""
    assert P.decode(P.encode(P.PING)).body == P.Ping()


@pytest.mark.parametrize("frames", [
    [b"CMPL0", P.PING, b"", b""],              # other protocol
    [P.PROTO, P.PING, b""],                    # too few frames
    [P.PROTO, P.PING, b"", b"[1]"],            # body not an object
    [P.PROTO, P.PING, b"", b"{nope"],          # body not JSON
    [P.PROTO, P.PING, b"\xff", b""],           # request id not ASCII
    [P.PROTO, P.PING, b"", b'{"x": ' + b"[" * 3000 + b"]" * 3000 + b"}"],  # too deep
    [P.PROTO, P.SUBMIT, b"r", b'{"id": "r", "model": "m", "generation": ' + b"[" * 3000 +
     b"]" * 3000 + b"}"],                     # ... in a field kept raw
])
def test_malformed_messages_raise_protocol_error(frames):
    with pytest.raises(P.ProtocolError):
        P.decode(frames)


def test_event_round_trip_and_validation():
    frames = P.encode_event(b"fe-0123456789ab", "cmpl-1", P.Text(seq=3, attempt=1, text="x"))
    assert frames[0] == b"fe-0123456789ab"
    assert P.decode_event(frames) == ("cmpl-1", P.Text(seq=3, attempt=1, text="x"))
    with pytest.raises(P.ProtocolError):
        P.decode_event([b"t", b"r", b'{"e": "text"}'])     # no sequence number
    with pytest.raises(P.ProtocolError, match="nested too deeply"):
        P.decode_event([b"t", b"r", b'{"e": "text", "seq": 0, "x": ' + b"[" * 3000 +
                        b"]" * 3000 + b"}"])


def test_frontend_ids_are_fixed_width_so_topics_never_prefix_each_other():
    ids = {P.new_frontend_id() for _ in range(100)}
    assert {len(i) for i in ids} == {P.FRONTEND_ID_LEN}


def test_endpoints_from_ipc_directory():
    e = Endpoints.from_base("ipc:///run/cs/")
    assert e.frontend == "ipc:///run/cs/frontend.sock"
    assert e.control == "ipc:///run/cs/control.sock"
    assert len(e.ipc_paths()) == 5


def test_endpoints_from_tcp_base_port():
    e = Endpoints.from_base("tcp://10.0.0.5:5550")
    assert [e.frontend, e.worker, e.tokens_in, e.tokens_out, e.control] == [
        f"tcp://10.0.0.5:{p}" for p in range(5550, 5555)]


@pytest.mark.parametrize("base", ["udp://x:1", "tcp://host", "tcp://:5550", "tcp://h:65535"])
def test_bad_dispatcher_addresses_are_rejected(base):
    with pytest.raises(ValueError):
        Endpoints.from_base(base)
