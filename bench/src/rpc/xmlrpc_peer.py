#!/usr/bin/env python3
"""XML-RPC peer of `fido-bench rpc` (the paper's XMLRPC baseline).

Python's standard xmlrpc.server / xmlrpc.client (HTTP/1.1 keep-alive) over a
Unix stream socket. Same calls, payloads and checksums as the Rust systems
(bench/src/rpc/data.rs):

  ByteSeq  xmlrpc Binary (base64) of 10*LEN bytes, byte k = (7k + seed) mod 256
  FixedSeq array of structs {i, j, d}: i = (k + seed) & 0x7fffffff,
           j = k & 0xffff, d = (k mod 10^6) + 0.5
  VarSeq   array of structs {s, d}: s = 10 letters 'a' + ((k + seed + m) mod 26),
           d = (k mod 10^6) + 0.25

Checksums (wrapping u64 sums) travel as decimal strings: XML-RPC integers are
32-bit. Usage:
  xmlrpc_peer.py server SOCKET CPU
  xmlrpc_peer.py client SOCKET CPU CASE WARM_MS DUR_MS   (prints one JSON line)
"""

import ctypes
import http.client
import json
import math
import os
import socket
import socketserver
import sys
import time
import xmlrpc.client
import xmlrpc.server

MASK = (1 << 64) - 1
VAR_STR = 10
ALPHA = "abcdefghijklmnopqrstuvwxyz" * 2
# Σ bytes of the 10-letter string starting at each letter.
ROT_SUM = [sum(ALPHA[r:r + VAR_STR].encode()) for r in range(26)]
MAX_LEN = 100_000_000


def prologue(cpu):
    # Die with the bench driver (PR_SET_PDEATHSIG = 1, SIGKILL = 9), refuse to
    # run orphaned, and take the CPU the driver chose.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    want = os.environ.get("FIDO_BENCH_PARENT")
    if want is not None and os.getppid() != int(want):
        sys.exit("xmlrpc peer: parent already gone")
    os.sched_setaffinity(0, {cpu})


def make_bytes(n, seed):
    pattern = bytes(((7 * k) + seed) & 255 for k in range(256))
    return (pattern * (n // 256 + 1))[:n]


def make_fixed(n, seed):
    return [{"i": (k + seed) & 0x7FFFFFFF, "j": k & 0xFFFF, "d": (k % 1_000_000) + 0.5}
            for k in range(n)]


def sum_fixed(seq):
    return sum(e["i"] + e["j"] + int(e["d"]) for e in seq) & MASK


def make_var(n, seed):
    return [{"s": ALPHA[(k + seed) % 26:(k + seed) % 26 + VAR_STR], "d": (k % 1_000_000) + 0.25}
            for k in range(n)]


def sum_var(seq):
    total = 0
    for e in seq:
        s = e["s"].encode()
        total += sum(s) + len(s) + int(e["d"])
    return total & MASK


def sum_var_expected(n, seed):
    return sum(ROT_SUM[(k + seed) % 26] + VAR_STR + int((k % 1_000_000) + 0.25)
               for k in range(n)) & MASK


def check_len(n):
    if not isinstance(n, int) or n < 0 or n > MAX_LEN:
        raise ValueError(f"bad LEN {n!r}")
    return n


# Test hook, as in the Rust servers: a wrong checksum must fail the bench.
CORRUPT = 1 if os.environ.get("FIDO_BENCH_RPC_CORRUPT") == "1" else 0


def srv_sum(total):
    return str((total + CORRUPT) & MASK)


class Service:
    def null(self):
        return None

    def send_bytes(self, b):
        return srv_sum(sum(b.data))

    def send_fixed(self, seq):
        return srv_sum(sum_fixed(seq))

    def send_var(self, seq):
        return srv_sum(sum_var(seq))

    def recv_bytes(self, n, seed):
        d = make_bytes(10 * check_len(n), seed)
        return [xmlrpc.client.Binary(d), srv_sum(sum(d))]

    def recv_fixed(self, n, seed):
        seq = make_fixed(check_len(n), seed)
        return [seq, srv_sum(sum_fixed(seq))]

    def recv_var(self, n, seed):
        seq = make_var(check_len(n), seed)
        return [seq, srv_sum(sum_var(seq))]


class Handler(xmlrpc.server.SimpleXMLRPCRequestHandler):
    # Keep-alive: one connection for every call, like the other systems.
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY does not exist on a Unix socket (and Nagle neither).
    disable_nagle_algorithm = False

    def address_string(self):
        return "unix"


class UnixXMLRPCServer(socketserver.UnixStreamServer, xmlrpc.server.SimpleXMLRPCDispatcher):
    def __init__(self, path):
        xmlrpc.server.SimpleXMLRPCDispatcher.__init__(self, allow_none=True, encoding=None)
        self.logRequests = False
        socketserver.UnixStreamServer.__init__(self, path, Handler)


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost")
        self.unix_path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(self.unix_path)
        self.sock = s


class UnixTransport(xmlrpc.client.Transport):
    def __init__(self, path):
        super().__init__()
        self.unix_path = path

    def make_connection(self, host):
        if self._connection and host == self._connection[0]:
            return self._connection[1]
        self._connection = host, UnixConnection(self.unix_path)
        return self._connection[1]


def serve(path, cpu):
    prologue(cpu)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    srv = UnixXMLRPCServer(path)
    srv.register_instance(Service())
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    srv.serve_forever()


def check(what, got, want):
    if got != want:
        raise SystemExit(f"checksum mismatch on {what}: got {got:#x}, expected {want:#x}")


def one_call(p, seq, direction, n, seed):
    if direction == "send":
        if seq == "byteseq":
            d = make_bytes(10 * n, seed)
            got, want = int(p.send_bytes(xmlrpc.client.Binary(d))), sum(d) & MASK
        elif seq == "fixedseq":
            s = make_fixed(n, seed)
            got, want = int(p.send_fixed(s)), sum_fixed(s)
        else:
            s = make_var(n, seed)
            got, want = int(p.send_var(s)), sum_var_expected(n, seed)
    else:
        if seq == "byteseq":
            d, total = p.recv_bytes(n, seed)
            if len(d.data) != 10 * n:
                raise SystemExit("short ByteSeq")
            got, want = sum(d.data) & MASK, int(total)
        elif seq == "fixedseq":
            s, total = p.recv_fixed(n, seed)
            if len(s) != n:
                raise SystemExit("short FixedSeq")
            got, want = sum_fixed(s), int(total)
        else:
            s, total = p.recv_var(n, seed)
            if len(s) != n:
                raise SystemExit("short VarSeq")
            got, want = sum_var(s), int(total)
    check(f"xmlrpc {direction}", got, want)


def quantile(sorted_samples, q):
    rank = min(max(math.ceil(q * len(sorted_samples)), 1), len(sorted_samples)) - 1
    return sorted_samples[rank]


PAYLOAD = {"byteseq": 10, "fixedseq": 16, "varseq": 8 + VAR_STR}


def client(path, cpu, case, warm_ms, dur_ms):
    prologue(cpu)
    p = xmlrpc.client.ServerProxy("http://localhost/RPC2", transport=UnixTransport(path),
                                  allow_none=True)
    warm, dur = warm_ms / 1e3, dur_ms / 1e3
    clock = time.monotonic
    if case.startswith("null-"):
        t = clock()
        while clock() - t < warm:
            p.null()
        samples = []
        start = clock()
        t0 = time.monotonic_ns()
        while True:
            p.null()
            t1 = time.monotonic_ns()
            samples.append(t1 - t0)
            t0 = t1
            if clock() - start >= dur:
                break
        samples.sort()
        out = {"calls": len(samples), "checked": 0, "secs": 0.0, "bytes": 0,
               "p50_ns": float(quantile(samples, 0.5)), "p99_ns": float(quantile(samples, 0.99))}
    else:
        seq, direction, n = case.split("-", 2)
        n = int(n)
        seed, checked = 1, 0
        t = clock()
        while True:
            one_call(p, seq, direction, n, seed)
            seed, checked = seed + 1, checked + 1
            if clock() - t >= warm:
                break
        calls = 0
        start = clock()
        while True:
            one_call(p, seq, direction, n, seed)
            seed, checked, calls = seed + 1, checked + 1, calls + 1
            secs = clock() - start
            if secs >= dur:
                break
        out = {"calls": calls, "checked": checked, "secs": secs,
               "bytes": calls * n * PAYLOAD[seq], "p50_ns": None, "p99_ns": None}
    print(json.dumps(out), flush=True)


def main(argv):
    if len(argv) >= 3 and argv[0] == "server":
        serve(argv[1], int(argv[2]))
    elif len(argv) >= 6 and argv[0] == "client":
        client(argv[1], int(argv[2]), argv[3], int(argv[4]), int(argv[5]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
