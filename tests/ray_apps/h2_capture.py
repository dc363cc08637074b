"""Raw HTTP/2 (h2c, prior knowledge) capture of gRPC calls, frame by frame: what Ray
Serve's gRPC proxy sends, down to which HEADERS frame carries `grpc-status` and whether it
has END_STREAM (trailers-only) or comes after the response headers (trailers).

Used to make tests/fixtures/ray-serve-2.60/grpc/ (see its README). Needs the pure-Python
`h2` package and, for the messages, protobuf plus the stubs of
tests/ray_apps/gen_grpc_stubs.sh and Ray's own `ray.serve.generated.serve_pb2`, for
example:

    pip install --target /tmp/h2lib h2
    PYTHONPATH=/tmp/h2lib:$STUBS .venv-ray/bin/python tests/ray_apps/h2_capture.py \
        127.0.0.1:9000 /ray.serve.RayServeAPIService/Healthz

    ... /ray_xds.demo.Echo/Say --md application=echo --msg '{"text": "hi"}'
    ... /ray_xds.demo.Echo/SayMany --msg '{"text": "hi", "count": 3, "every_ms": 100}'
    ... /ray_xds.demo.Echo/Say --streams 5 --msg '{"text": "x"}'   # 5 concurrent calls

Every call is a stream on one connection, all opened at once. The log has one line per
frame received (type, stream, flags, length), the decoded header blocks, each gRPC
message decoded, and a per-stream summary: `trailers-only` when `grpc-status` came in the
first and only HEADERS frame (with END_STREAM), `headers+trailers` when it came in a
second HEADERS frame after the response headers (and any DATA).
"""

import argparse
import json
import socket
import sys
import time

import h2.config
import h2.connection
import h2.events
from hyperframe.frame import Frame

REQUEST_TYPES = {
    "Healthz": ("ray.serve.generated.serve_pb2", "HealthzRequest"),
    "ListApplications": ("ray.serve.generated.serve_pb2", "ListApplicationsRequest"),
    "Say": ("ray_xds.demo.echo_pb2", "SayRequest"),
    "SayMany": ("ray_xds.demo.echo_pb2", "SayManyRequest"),
    "Chat": ("ray_xds.demo.echo_pb2", "SayRequest"),
}
RESPONSE_TYPES = {
    "Healthz": ("ray.serve.generated.serve_pb2", "HealthzResponse"),
    "ListApplications": ("ray.serve.generated.serve_pb2", "ListApplicationsResponse"),
    "Say": ("ray_xds.demo.echo_pb2", "Served"),
    "SayMany": ("ray_xds.demo.echo_pb2", "Served"),
    "Chat": ("ray_xds.demo.echo_pb2", "Served"),
}


def message_class(table, path):
    import importlib

    method = path.rsplit("/", 1)[-1]
    if method not in table:
        return None
    module, name = table[method]
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def grpc_frame(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def encode_request(path, msg_json):
    from google.protobuf import json_format

    cls = message_class(REQUEST_TYPES, path)
    if cls is None:
        return b""
    return json_format.Parse(msg_json, cls()).SerializeToString()


def decode_messages(buf: bytearray, cls):
    """Pops complete gRPC messages off `buf`; returns printable strings."""
    from google.protobuf import json_format

    out = []
    while len(buf) >= 5:
        n = int.from_bytes(buf[1:5], "big")
        if len(buf) < 5 + n:
            break
        compressed, payload = buf[0], bytes(buf[5 : 5 + n])
        del buf[: 5 + n]
        text = f"grpc message: compressed={compressed} length={n}"
        if cls is not None and not compressed:
            try:
                m = cls.FromString(payload)
                text += " " + json.dumps(
                    json_format.MessageToDict(m, preserving_proto_field_name=True),
                    sort_keys=True,
                )
            except Exception as e:  # noqa: BLE001
                text += f" (undecodable: {e}) {payload!r}"
        else:
            text += f" {payload!r}"
        out.append(text)
    return out


def frame_line(frame) -> str:
    kind = type(frame).__name__.replace("Frame", "").upper()
    if kind == "GOAWAY":
        extra = f" last_stream_id={frame.last_stream_id} error_code={frame.error_code} debug={frame.additional_data!r}"
    elif kind == "RSTSTREAM":
        extra = f" error_code={frame.error_code}"
    elif kind == "WINDOWUPDATE":
        extra = f" increment={frame.window_increment}"
    elif kind == "SETTINGS":
        extra = f" {dict(frame.settings)}" if frame.settings else ""
    elif kind == "PING":
        extra = f" opaque={frame.opaque_data!r}"
    else:
        extra = ""
    flags = sorted(frame.flags)
    return f"frame {kind} stream={frame.stream_id} flags=[{','.join(flags)}] length={frame.body_len}{extra}"


class Capture:
    def __init__(self, out):
        self.out = out
        self.t0 = time.monotonic()

    def log(self, text):
        ms = (time.monotonic() - self.t0) * 1000
        line = f"{ms:9.1f} ms  {text}"
        self.out.write(line + "\n")
        self.out.flush()


def run(addr, calls, timeout_s, log: Capture, hold_s=0.0):
    """`calls`: list of (path, metadata list, [message bytes], end_stream, gap_s)."""
    host, port = addr.rsplit(":", 1)
    started = time.monotonic()
    try:
        sock = socket.create_connection((host, int(port)), timeout=5)
    except OSError as e:
        log.log(f"connect {addr}: {type(e).__name__}: {e}")
        return {}
    log.log(f"connected to {addr}")
    sock.settimeout(0.2)
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    state = {}
    for path, metadata, messages, end_stream, gap_s in calls:
        sid = conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", addr),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ] + metadata
        conn.send_headers(sid, headers)
        log.log(f"sent HEADERS stream={sid} {headers}")
        state[sid] = {
            "path": path,
            "header_blocks": [],
            "data": 0,
            "buf": bytearray(),
            "done": None,
            "pending": list(messages),
            "end_stream": end_stream,
            "gap_s": gap_s,
            "next_send": time.monotonic(),
            "cls": message_class(RESPONSE_TYPES, path),
        }
    sock.sendall(conn.data_to_send())
    raw = bytearray()
    closed = False

    def send_pending():
        now = time.monotonic()
        for sid, st in state.items():
            if st["done"]:
                continue
            while st["pending"] and now >= st["next_send"]:
                msg = st["pending"].pop(0)
                last = not st["pending"] and st["end_stream"]
                conn.send_data(sid, grpc_frame(msg), end_stream=last)
                log.log(f"sent DATA stream={sid} grpc message length={len(msg)}" + (" END_STREAM" if last else ""))
                st["next_send"] = now + st["gap_s"]
                if st["gap_s"]:
                    break
        data = conn.data_to_send()
        if data:
            sock.sendall(data)

    while True:
        if all(st["done"] for st in state.values()) and time.monotonic() - started >= hold_s:
            break
        if time.monotonic() - started > timeout_s:
            log.log(f"timeout after {timeout_s}s; streams not done: {[s for s, st in state.items() if not st['done']]}")
            break
        if closed:
            break
        try:
            send_pending()
        except Exception as e:  # noqa: BLE001
            log.log(f"send: {type(e).__name__}: {e}")
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError as e:
            log.log(f"recv: {type(e).__name__}: {e}")
            closed = True
            break
        if not chunk:
            log.log("recv: EOF (the server closed the TCP connection)")
            closed = True
            break
        raw += chunk
        while len(raw) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(raw[:9]))
            if len(raw) < 9 + length:
                break
            frame.parse_body(memoryview(raw[9 : 9 + length]))
            del raw[: 9 + length]
            log.log(frame_line(frame))
        try:
            events = conn.receive_data(chunk)
        except Exception as e:  # noqa: BLE001
            log.log(f"h2 protocol error: {type(e).__name__}: {e}")
            closed = True
            break
        for ev in events:
            sid = getattr(ev, "stream_id", None)
            st = state.get(sid)
            if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                kind = "response headers" if isinstance(ev, h2.events.ResponseReceived) else "trailers"
                hdrs = [(k, v) for k, v in ev.headers]
                st["header_blocks"].append((kind, hdrs, ev.stream_ended is not None))
                log.log(f"  {kind} stream={sid}: {hdrs}" + (" (END_STREAM)" if ev.stream_ended else ""))
            elif isinstance(ev, h2.events.DataReceived):
                st["data"] += len(ev.data)
                st["buf"] += ev.data
                conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                for m in decode_messages(st["buf"], st["cls"]):
                    log.log(f"  stream={sid} {m}")
            elif isinstance(ev, h2.events.StreamEnded):
                st["done"] = "ended"
            elif isinstance(ev, h2.events.StreamReset):
                log.log(f"  stream={sid} reset by server, error_code={ev.error_code!r}")
                if st:
                    st["done"] = f"reset {ev.error_code!r}"
            elif isinstance(ev, h2.events.ConnectionTerminated):
                log.log(f"  connection terminated (GOAWAY) error_code={ev.error_code!r} last_stream_id={ev.last_stream_id} data={ev.additional_data!r}")
                for s, st2 in state.items():
                    if not st2["done"] and s > (ev.last_stream_id or 0):
                        st2["done"] = "refused by GOAWAY"
        data = conn.data_to_send()
        if data:
            try:
                sock.sendall(data)
            except OSError:
                pass
    for sid, st in state.items():
        blocks = st["header_blocks"]
        status_block = next((i for i, b in enumerate(blocks) if any(k == "grpc-status" for k, _ in b[1])), None)
        if status_block is None:
            shape = "no grpc-status received"
        elif status_block == 0 and blocks[0][2]:
            shape = "trailers-only (grpc-status in the only HEADERS frame, END_STREAM)"
        elif status_block == 0:
            shape = "grpc-status in the first HEADERS frame without END_STREAM (!)"
        else:
            shape = f"headers+trailers (grpc-status in HEADERS frame #{status_block + 1}, after {st['data']} DATA bytes)"
        status = next((dict(b[1]).get("grpc-status") for b in blocks if any(k == "grpc-status" for k, _ in b[1])), None)
        msg = next((dict(b[1]).get("grpc-message") for b in blocks if any(k == "grpc-status" for k, _ in b[1])), None)
        log.log(f"summary stream={sid} {st['path']}: end={st['done']} grpc-status={status} grpc-message={msg!r} shape: {shape}")
    try:
        sock.close()
    except OSError:
        pass
    return state


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("addr", help="host:port of the gRPC proxy")
    p.add_argument("path", help="/package.Service/Method")
    p.add_argument("--md", action="append", default=[], help="metadata key=value (repeatable)")
    p.add_argument("--msg", action="append", default=None, help="request message as JSON (repeatable: a stream); default one empty message")
    p.add_argument("--gap-ms", type=float, default=0, help="pause between request messages")
    p.add_argument("--no-end-stream", action="store_true", help="keep the request stream open")
    p.add_argument("--streams", type=int, default=1, help="this many identical calls at once")
    p.add_argument("--timeout", type=float, default=30)
    p.add_argument("--hold", type=float, default=0, help="keep reading at least this long")
    p.add_argument("--out", help="append the log to this file (and print it)")
    a = p.parse_args()
    metadata = [tuple(kv.split("=", 1)) for kv in a.md]
    msgs = [encode_request(a.path, m) for m in (a.msg or ["{}"])]
    calls = [(a.path, metadata, msgs, False if a.no_end_stream else True, a.gap_ms / 1000.0)] * a.streams

    class Tee:
        def __init__(self, files):
            self.files = files

        def write(self, s):
            for f in self.files:
                f.write(s)

        def flush(self):
            for f in self.files:
                f.flush()

    files = [sys.stdout]
    if a.out:
        files.append(open(a.out, "a"))
    log = Capture(Tee(files))
    log.log(f"# {a.path} metadata={metadata} messages={a.msg or ['{}']} streams={a.streams}")
    run(a.addr, calls, a.timeout, log, a.hold)


if __name__ == "__main__":
    main()
