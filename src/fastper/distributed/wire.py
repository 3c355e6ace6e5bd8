"""A direct socket channel from the learner to each shard: the hot path without Ray's per-call price.

A Ray actor call costs about a millisecond (half of it CPU in the caller) on
a small machine, whatever it carries. The learner's two hot calls, a shard's
``step`` (apply priority updates, draw rows) and ``view``, go instead over
one TCP connection per shard that the shard opens when asked
(:meth:`ShardHost.open_channel <fastper.distributed.ray_backend.ShardHost.open_channel>`);
everything else (start, inserts from actors, saves, restarts, faults) stays
with Ray. A round trip on the channel costs tens of microseconds.

The format is fastper's own and carries numbers only, never pickle: a frame
is a fixed header (magic, version, lengths), a JSON header naming the
method and describing each array (name, dtype, shape), then the arrays'
raw bytes. Only plain numeric dtypes are accepted (bool, integers, floats),
and every size is checked against the frame before a byte is read as an
array, so a corrupt or hostile frame is refused, never evaluated. A
connection must first present the shard's random token (compared in
constant time); the server binds to the node's own address, or, for a
learner on the same host, to a Linux abstract Unix socket (no file; about a
tenth of TCP loopback's cost per call).

Calls on one channel are answered in the order sent (one server thread per
connection runs them one after another), so several may be in flight:
:class:`Channel` numbers them and hands each reply to its call.
"""

from __future__ import annotations

import hmac
import json
import math
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .. import errors as _errors
from .transport import ShardLostError

__all__ = ["Channel", "ChannelServer", "ChannelTransport", "WireError", "decode", "encode", "local_channels"]

_MAGIC = b"FPW1"
_HEAD = struct.Struct("<4sIQ")  # magic, JSON header bytes, array bytes
_MAX_JSON = 1 << 20
_MAX_BODY = 1 << 34
_KINDS = frozenset("biuf")
TOKEN_BYTES = 32
#: a TCP ``(host, port)``, or the name of a Linux abstract socket (shards on the learner's host)
Address = tuple[str, int] | str
#: abstract Unix sockets (Linux): a tenth of TCP loopback's cost per call on one host
UNIX_OK = sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")

#: errors a shard's method may raise that come back as themselves (others: RuntimeError)
_ERRORS: dict[str, type[BaseException]] = {
    e.__name__: e
    for e in (
        ValueError, TypeError, IndexError, KeyError, RuntimeError,
        _errors.EmptyBufferError, _errors.ZeroPriorityError, _errors.InvalidIndexError,
        _errors.FieldTypeError, _errors.CheckpointError,
    )
}  # fmt: skip


class WireError(_errors.FastPERError, ValueError):
    """A frame that is not fastper's channel format (corrupt, truncated or foreign)."""


def encode(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> list[Any]:
    """One frame as a list of buffers (header, JSON, then each array's bytes, not copied)."""
    specs, bufs, total = [], [], 0
    for name, a in arrays.items():
        arr = np.ascontiguousarray(a)
        if arr.dtype.kind not in _KINDS:
            raise TypeError(f"channel arrays must be numeric, got {name} of dtype {arr.dtype}")
        specs.append([name, arr.dtype.str, list(arr.shape)])
        bufs.append(arr.reshape(-1).view(np.uint8).data if arr.nbytes else b"")
        total += arr.nbytes
    head = json.dumps({"meta": dict(meta), "arrays": specs}, separators=(",", ":")).encode()
    return [_HEAD.pack(_MAGIC, len(head), total), head, *bufs]


def decode(head: bytes, body: bytearray | bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The (meta, arrays) of a frame's JSON header and body; the arrays view ``body``.

    Raises:
        WireError: anything that does not describe ``body`` exactly.
    """
    try:
        doc = json.loads(head)
        meta, specs = doc["meta"], doc["arrays"]
        if not isinstance(meta, dict) or not isinstance(specs, list):
            raise TypeError("bad header")
    except (ValueError, TypeError, KeyError) as exc:
        raise WireError(f"a channel frame with an unreadable header: {exc}") from None
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    view = memoryview(body)
    for spec in specs:
        try:
            name, dtype_str, shape = spec
            dtype = np.dtype(str(dtype_str))
            shape = tuple(int(d) for d in shape)
        except (ValueError, TypeError) as exc:
            raise WireError(f"a channel frame with a bad array spec {spec!r}: {exc}") from None
        if dtype.kind not in _KINDS or dtype.hasobject or any(d < 0 for d in shape):
            raise WireError(f"a channel frame with a refused array spec {spec!r}")
        n = math.prod(shape) * dtype.itemsize
        if offset + n > len(body):
            raise WireError("a channel frame whose arrays overrun its body")
        arrays[str(name)] = np.frombuffer(view[offset : offset + n], dtype=dtype).reshape(shape)
        offset += n
    if offset != len(body):
        raise WireError("a channel frame with bytes no array describes")
    return meta, arrays


def _recv_exact(sock: socket.socket, n: int, into: bytearray | None = None) -> bytearray:
    buf = bytearray(n) if into is None else into
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the connection was closed")
        got += k
    return buf


class FrameReader:
    """Reads frames from a socket with as few system calls as it can (usually one a frame).

    Bytes that arrive beyond a frame (the next replies, sent back to back)
    stay buffered for the next :meth:`read`.
    """

    def __init__(self, sock: socket.socket, size: int = 1 << 16) -> None:
        self.sock = sock
        self._buf = bytearray(size)
        self._start = self._end = 0

    def _fill(self, n: int) -> None:
        """At least ``n`` unread bytes in the buffer (blocking, under the socket's timeout)."""
        if self._end - self._start >= n:
            return
        if self._start + n > len(self._buf):  # room at the front, or a larger buffer
            have = self._end - self._start
            buf = self._buf if n <= len(self._buf) else bytearray(max(n, 2 * len(self._buf)))
            buf[:have] = self._buf[self._start : self._end]
            self._buf, self._start, self._end = buf, 0, have
        view = memoryview(self._buf)
        while self._end - self._start < n:
            k = self.sock.recv_into(view[self._end :])
            if k == 0:
                raise ConnectionError("the connection was closed")
            self._end += k

    def read(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """One frame: its (meta, arrays); the arrays own their bytes."""
        self._fill(_HEAD.size)
        magic, hlen, blen = _HEAD.unpack_from(self._buf, self._start)
        if magic != _MAGIC or hlen > _MAX_JSON or blen > _MAX_BODY:
            raise WireError("a frame that is not fastper's channel format (bad magic or sizes)")
        self._fill(_HEAD.size + hlen + blen)
        at = self._start + _HEAD.size
        head = bytes(self._buf[at : at + hlen])
        body = bytearray(self._buf[at + hlen : at + hlen + blen])  # a copy: the buffer is reused
        self._start = at + hlen + blen
        if self._start == self._end:
            self._start = self._end = 0
        return decode(head, body)


def _sendall_msg(sock: socket.socket, parts: list[Any]) -> None:
    total = sum(memoryview(p).nbytes for p in parts)
    sent = sock.sendmsg(parts)
    if sent == total:
        return
    joined = b"".join(bytes(p) for p in parts)  # a partial send: the rest in one go
    sock.sendall(joined[sent:])


# -- the shard's side -------------------------------------------------------------------
class ChannelServer:
    """Serves ``methods`` of one shard over TCP, one thread per connection (daemon threads).

    Args:
        methods: name -> callable taking ``(meta, arrays)`` and returning
            ``(meta, arrays)``; nothing else can be called.
        token: the secret a connection must present first (bytes).
        host: the address to bind (the node's own IP).
    """

    def __init__(
        self,
        methods: Mapping[str, Callable[[dict[str, Any], dict[str, np.ndarray]], Any]],
        token: bytes,
        host: str = "127.0.0.1",
        *,
        local: bool = False,
    ) -> None:
        self._methods = dict(methods)
        self._token = bytes(token)
        self.address: Address
        if local and UNIX_OK:  # a Linux abstract socket: no file, this host only
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            name = "\0fastper-" + secrets.token_hex(12)
            self._sock.bind(name)
            self._sock.listen(16)
            self.address = name
        else:
            self._sock = socket.create_server((host, 0), backlog=16)
            self.address = tuple(self._sock.getsockname()[:2])
        self._closed = False
        threading.Thread(target=self._accept, name="fastper-channel", daemon=True).start()

    def close(self) -> None:
        """Stop accepting connections (the open ones end with their clients)."""
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn.settimeout(10.0)
                token = bytes(_recv_exact(conn, TOKEN_BYTES))
                if not hmac.compare_digest(token, self._token):
                    return
                conn.settimeout(None)
                conn.sendall(b"OK")
                # replies go out from their own thread, so that requests keep being read
                # while a reply waits for the learner to read it: a learner with several
                # calls in flight, blocked sending the next one, can never wait on us
                replies: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
                writer = threading.Thread(target=self._write, args=(conn, replies), daemon=True)
                writer.start()
                reader = FrameReader(conn)
                try:
                    while True:
                        meta, arrays = reader.read()
                        replies.put(self._answer(meta, arrays))
                finally:
                    replies.put(None)
                    writer.join(timeout=10.0)
            except (OSError, ConnectionError, WireError):
                return

    @staticmethod
    def _write(conn: socket.socket, replies: queue.SimpleQueue[list[Any] | None]) -> None:
        """Send the replies in order until told to stop (``None``) or the connection breaks."""
        while True:
            parts = replies.get()
            if parts is None:
                return
            try:
                _sendall_msg(conn, parts)
            except OSError:
                return

    def _answer(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> list[Any]:
        seq = meta.get("seq")
        method = self._methods.get(str(meta.get("method")))
        try:
            if method is None:
                raise ValueError(f"the channel has no method {meta.get('method')!r}")
            out_meta, out_arrays = method(meta.get("args", {}), arrays)
            return encode({"seq": seq, **out_meta}, out_arrays)
        except Exception as exc:  # noqa: BLE001 - sent back to the caller, raised there
            name = type(exc).__name__ if type(exc).__name__ in _ERRORS else "RuntimeError"
            message = str(exc) if name != "RuntimeError" else f"{type(exc).__name__}: {exc}"
            return encode({"seq": seq, "error": name, "message": message}, {})


# -- the learner's side -------------------------------------------------------------------
class ChannelCall:
    """A call sent on a channel and not yet answered."""

    __slots__ = ("channel", "outcome", "seq", "shard")

    def __init__(self, shard: int, channel: Channel, seq: int) -> None:
        self.shard, self.channel, self.seq = shard, channel, seq
        self.outcome: tuple[Any, ...] | None = None  # (reply,) or (None, error) once read


class Channel:
    """The learner's connection to one shard's :class:`ChannelServer`.

    Calls are numbered; :meth:`result` reads replies in order and keeps those
    of earlier calls for their own :meth:`result`. A closed connection, a
    corrupt frame, or no reply by the deadline raises :class:`ShardLostError`
    (and the channel is closed: its replies would be out of step).
    """

    def __init__(self, shard: int, address: Address, token: bytes, timeout: float) -> None:
        self.shard = shard
        if isinstance(address, str):
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(timeout)
            self._sock.connect(address)
        else:
            self._sock = socket.create_connection((str(address[0]), int(address[1])), timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(bytes(token))
        if bytes(_recv_exact(self._sock, 2)) != b"OK":
            raise ConnectionError("the shard refused the channel's token")
        self._sock.settimeout(None)
        self._timeout_set = False
        self._reader = FrameReader(self._sock)
        self._next = 0
        self._read = 0
        self._early: dict[int, tuple[dict[str, Any], dict[str, np.ndarray]]] = {}
        self._broken: str | None = None

    @property
    def in_flight(self) -> int:
        """Calls sent and not yet read back."""
        return self._next - self._read

    def close(self) -> None:
        """Close the connection (calls in flight are lost)."""
        if self._broken is None:
            self._broken = "the channel was closed"
        try:
            self._sock.close()
        except OSError:
            pass

    def send(self, method: str, args: Mapping[str, Any], arrays: Mapping[str, Any]) -> ChannelCall:
        """Send one call; returns at once (the reply is read by :meth:`result`)."""
        seq = self._next
        self._next += 1
        if self._broken is None:  # a broken channel's calls raise when their result is asked
            try:
                _sendall_msg(self._sock, encode({"seq": seq, "method": method, "args": dict(args)},
                                                arrays))  # fmt: skip
            except OSError as exc:
                self._broken = f"sending failed ({exc})"
        return ChannelCall(self.shard, self, seq)

    def result(self, call: ChannelCall, deadline: float | None) -> Any:
        """The reply to ``call``: ``(meta, arrays)``, or the shard method's error raised here.

        Asking again gives the same answer (as ``ray.get`` of a reference does).
        """
        if call.outcome is None:
            try:
                call.outcome = (self._read_reply(call, deadline),)
            except ShardLostError:
                raise  # not kept: the channel itself says so from now on
            except BaseException as exc:  # noqa: BLE001 - the shard method's error, kept
                call.outcome = (None, exc)
        if len(call.outcome) == 2:
            raise call.outcome[1]
        return call.outcome[0]

    def _read_reply(self, call: ChannelCall, deadline: float | None) -> Any:
        while call.seq not in self._early:
            self._check()
            if deadline is None:
                if self._timeout_set:  # a syscall: only when it changes
                    self._sock.settimeout(None)
                    self._timeout_set = False
            else:
                left = deadline - time.monotonic()
                if left <= 0.0:
                    self._fail("no reply within the timeout (treated as lost)")
                self._sock.settimeout(left)
                self._timeout_set = True
            try:
                meta, arrays = self._reader.read()
            except TimeoutError:
                self._fail("no reply within the timeout (treated as lost)")
            except (OSError, ConnectionError, WireError) as exc:
                self._fail(f"its channel broke ({exc})")
            self._early[int(meta.get("seq", -1))] = (meta, arrays)
            self._read += 1
        meta, arrays = self._early.pop(call.seq)
        if "error" in meta:
            raise _ERRORS.get(str(meta["error"]), RuntimeError)(str(meta.get("message", "")))
        return meta, arrays

    def _check(self) -> None:
        if self._broken is not None:
            raise ShardLostError(self.shard, self._broken)

    def _fail(self, why: str) -> None:
        self._broken = why
        try:
            self._sock.close()
        except OSError:
            pass
        raise ShardLostError(self.shard, why)


# -- the transport ---------------------------------------------------------------------------
#: shard methods that go over the channel (everything else goes through the inner transport)
CHANNEL_METHODS = frozenset({"step"})


def step_call(args: tuple[Any, ...]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``Shard.step``'s positional arguments as the channel's (args, arrays)."""
    slots, td, keys, targets, view_total = (tuple(args) + (None,) * 5)[:5]
    arrays: dict[str, np.ndarray] = {}
    if slots is not None and len(slots):
        arrays["slots"] = np.asarray(slots, dtype=np.int64)
        arrays["td_errors"] = np.asarray(td, dtype=np.float64)
        if keys is not None:
            arrays["keys"] = np.asarray(keys, dtype=np.int64)
    if targets is not None and len(targets):
        arrays["targets"] = np.asarray(targets, dtype=np.float64)
    meta = {"keyed": keys is not None, "view_total": float(view_total or 0.0)}
    return meta, arrays


class ChannelTransport:
    """A :class:`~fastper.distributed.Transport` that sends ``step`` calls over socket channels.

    Every other call (``add``, ``get``, ``save``, ``describe``, restarts,
    ...) goes through ``inner`` (the Ray transport), and so do the
    attributes this class does not have (``actors``, ``router``, ``kill``,
    ...). After :meth:`restart` the shard's channel is opened again.

    Args:
        inner: the transport the shards were started with.
        connect: opens a channel to shard ``s`` (asks it to listen, then connects).
        timeout: seconds a reply may take (``None``: ``inner.timeout``).
    """

    def __init__(self, inner: Any, connect: Callable[[int], Channel]) -> None:
        self.inner = inner
        self._connect = connect
        self._channels: list[Channel | None] = [None] * inner.n_shards
        try:
            for s in range(inner.n_shards):
                self._channels[s] = connect(s)
        except BaseException:
            self.close_channels()
            raise

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "_connect", "_channels"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def n_shards(self) -> int:
        """Number of shards, lost ones included."""
        return int(self.inner.n_shards)

    @property
    def timeout(self) -> float | None:
        """Seconds a reply may take before its shard counts as lost (the inner transport's)."""
        return getattr(self.inner, "timeout", None)

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self.inner.timeout = value

    def submit(self, shard: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Send one call: ``step`` on the shard's channel, anything else through ``inner``."""
        channel = self._channels[shard]
        if method in CHANNEL_METHODS and channel is not None and not kwargs:
            meta, arrays = step_call(args)
            return channel.send(method, meta, arrays)
        return self.inner.submit(shard, method, *args, **kwargs)

    def results(self, pending: Any) -> list[Any]:
        """The calls' results in order; the first error raised (a lost shard: ShardLostError)."""
        pending = list(pending)
        timeout = self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Any] = [None] * len(pending)
        others = [i for i, p in enumerate(pending) if not isinstance(p, ChannelCall)]
        error: BaseException | None = None
        for i, p in enumerate(pending):
            if not isinstance(p, ChannelCall):
                continue
            try:
                out[i] = p.channel.result(p, deadline)[1]
            except BaseException as exc:  # noqa: BLE001 - every reply is read; the first error raised
                error = error or exc
        if others:
            try:
                for i, r in zip(others, self.inner.results([pending[i] for i in others]), strict=True):
                    out[i] = r
            except BaseException as exc:  # noqa: BLE001 - raised below, after the channels' errors
                error = error or exc
        if error is not None:
            raise error
        return out

    def restart(self, shard: int, checkpoint: str) -> None:
        """Replace a lost shard by one loaded from its checkpoint; open its channel again."""
        old = self._channels[shard]
        if old is not None:
            old.close()
        self._channels[shard] = None
        self.inner.restart(shard, checkpoint)
        self._channels[shard] = self._connect(shard)

    def kill(self, shard: int) -> None:
        """Kill the shard (``inner.kill``) and close its channel."""
        channel = self._channels[shard]
        if channel is not None:
            channel.close()
        kill = getattr(self.inner, "kill", None)
        if kill is not None:
            kill(shard)

    def close_channels(self) -> None:
        """Close every channel (the shards keep running)."""
        for c in self._channels:
            if c is not None:
                c.close()

    def close(self) -> None:
        """Close the channels and the inner transport's shards."""
        self.close_channels()
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


def local_channels(transport: Any) -> ChannelTransport:
    """Channels to the shards of a :class:`~fastper.distributed.LocalTransport`, served by
    threads of this process (tests, and measuring the channel without Ray)."""
    servers: dict[int, ChannelServer] = {}

    def connect(s: int) -> Channel:
        import secrets

        token = secrets.token_bytes(TOKEN_BYTES)
        old = servers.pop(s, None)
        if old is not None:
            old.close()
        servers[s] = server = ChannelServer({"step": transport.shards[s].channel_step}, token,
                                            local=True)  # fmt: skip
        return Channel(s, server.address, token, timeout=10.0)

    return ChannelTransport(transport, connect)
