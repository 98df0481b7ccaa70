"""A loopback HTTP proxy in front of the S3 test server that makes it misbehave on purpose: answer
503 SlowDown (throttling) or 500 to the next N requests, drop the connection mid-request, add
latency per request and cap bandwidth. The tests use it for faults the real server will not
produce on demand; the benchmark uses it to make the store slow. Bounded: it serves loopback
only and stops with its owner."""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class Proxy:
    def __init__(self, upstream: str, *, latency_s: float = 0.0, bandwidth_bps: float | None = None,
                 conn_bandwidth_bps: float | None = None, ranged_200_as_206: bool = False) -> None:
        """``bandwidth_bps``: one cap shared by everything through the proxy (the store's total);
        ``conn_bandwidth_bps``: a cap per request (a store serves each connection at a bounded
        rate, tens of MB/s on S3: parallel requests are how a client goes faster);
        ``ranged_200_as_206``: a ranged GET answered ``200`` with a ``Content-Range`` (rclone's S3
        server) is passed on as the ``206`` S3 sends (the benchmark's realistic server; obstore
        refuses the 200)."""
        u = urlsplit(upstream)
        self.up_host, self.up_port = u.hostname, u.port
        self.latency_s, self.bandwidth_bps, self.conn_bps = latency_s, bandwidth_bps, conn_bandwidth_bps
        self.lock = threading.Lock()
        self.fail: list[tuple[int, str]] = []  # (status, S3 error code) for the next requests
        self.drop = 0  # connections to drop (request read, nothing answered)
        self.lose = 0  # replies to lose: the request reaches the server, its answer never the client
        self.lose_path = ""  # ... only for requests whose path contains this
        # forward without If-None-Match / If-Match (a store that ignores them): True for both, or
        # one header's name in lower case (a store that honours only the other)
        self.strip_conditions: bool | str = False
        self.only: str | None = None  # faults apply to methods of this name only (None: all)
        # flip one byte of an object in GET replies: (path containing this, the byte's offset in the
        # object, how many replies to corrupt: -1 for every one). A store serving other bytes than
        # it stored, or a network corrupting them past TCP's checksum: no server does it on demand
        self.flip: tuple[str, int, int] | None = None
        self.flipped = 0
        self.requests = 0
        self.bytes_in = 0  # request bodies received (uploads)
        self.bytes_out = 0  # response bodies sent (downloads)
        self.log: list[tuple[str, str]] = []  # (method, path with query) of every request, in order
        self.arrived: list[float] = []  # when each request of ``log`` reached the proxy (perf_counter)
        self.last_authorization = ""  # to check which credentials a client signed with
        self.faults_served = 0
        self._bucket = _TokenBucket(bandwidth_bps) if bandwidth_bps else None
        self.ranged_200_as_206 = ranged_200_as_206
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # headers and body go out as two writes: with Nagle on, a small body waits for the
            # client's delayed ACK of the headers (~40 ms per request on Linux loopback, measured),
            # a cost no real store has and that fell hardest on clients with more small requests
            disable_nagle_algorithm = True

            def log_message(self, *a) -> None:  # quiet
                pass

            def _any(self) -> None:
                proxy.handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail_next(self, n: int, status: int = 503, code: str = "SlowDown", method: str | None = None) -> None:
        with self.lock:
            self.fail = [(status, code)] * n
            self.only = method

    def drop_next(self, n: int, method: str | None = None) -> None:
        with self.lock:
            self.drop, self.only = n, method

    def lose_reply_next(self, n: int, method: str | None = None, path_contains: str = "") -> None:
        """The next ``n`` matching requests are applied by the server, then the connection is
        dropped without its reply (what a network failure after the store acted looks like)."""
        with self.lock:
            self.lose, self.only, self.lose_path = n, method, path_contains

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        arrived = time.perf_counter()
        n = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(n) if n else b""
        if self.latency_s:
            time.sleep(self.latency_s)
        if body:
            self._pace(len(body))
        with self.lock:
            self.requests += 1
            self.bytes_in += len(body)
            self.log.append((h.command, h.path))
            self.arrived.append(arrived)
            self.last_authorization = h.headers.get("Authorization", "")
            applies = self.only is None or self.only == h.command
            fault = self.fail.pop(0) if self.fail and applies else None
            drop = applies and self.drop > 0
            if drop:
                self.drop -= 1
            lose = applies and self.lose > 0 and self.lose_path in h.path
            if lose:
                self.lose -= 1
            if fault or drop or lose:
                self.faults_served += 1
        if drop:
            h.close_connection = True
            h.connection.shutdown(2)
            return
        if fault:
            msg = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault[1]}</Code>'
                   f"<Message>injected by the test proxy</Message></Error>").encode()
            h.send_response(fault[0])
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(msg)))
            h.end_headers()
            h.wfile.write(msg)
            return
        conn = http.client.HTTPConnection(self.up_host, self.up_port, timeout=60)
        strip = self.strip_conditions
        dropped = ("connection",) + (("if-none-match", "if-match") if strip is True else (strip,) if strip else ())
        headers = {k: v for k, v in h.headers.items() if k.lower() not in dropped}
        conn.request(h.command, h.path, body=body if n or h.command in ("PUT", "POST") else None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        if lose:  # the server applied it; the client never hears
            conn.close()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        status, reason = resp.status, resp.reason
        if self.flip and h.command == "GET" and self.flip[0] in h.path and status in (200, 206):
            data = self._flipped(data, resp.getheader("Content-Range"))
        if self.ranged_200_as_206 and status == 200 and h.headers.get("Range") and resp.getheader("Content-Range"):
            status, reason = 206, "Partial Content"
        h.send_response(status, reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                h.send_header(k, v)
        h.send_header("Content-Length", resp.getheader("Content-Length", "0") if h.command == "HEAD" else str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            with self.lock:
                self.bytes_out += len(data)
            if self._bucket or self.conn_bps:
                for i in range(0, len(data), 1 << 16):
                    self._pace(min(1 << 16, len(data) - i))
                    h.wfile.write(data[i:i + (1 << 16)])
            else:
                h.wfile.write(data)
        conn.close()

    def _flipped(self, data: bytes, content_range: str | None) -> bytes:
        _, at, times = self.flip
        start = int(content_range.split()[1].split("-")[0]) if content_range else 0
        if not start <= at < start + len(data):
            return data
        with self.lock:
            if times == 0:
                return data
            self.flip = (self.flip[0], at, times - 1 if times > 0 else times)
            self.flipped += 1
        body = bytearray(data)
        body[at - start] ^= 0x01
        return bytes(body)

    def _pace(self, n: int) -> None:
        if self.conn_bps:  # this request's own rate
            time.sleep(n / self.conn_bps)
        if self._bucket:  # and the store's total
            self._bucket.take(n)


class _TokenBucket:
    """One shared bandwidth cap for everything through the proxy."""

    def __init__(self, rate: float) -> None:
        self.rate, self.lock = rate, threading.Lock()
        self.next_free = time.monotonic()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + n / self.rate
            wait = self.next_free - now
        if wait > 0:
            time.sleep(wait)
