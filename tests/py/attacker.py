"""An attacker's own client of the connector's native side channel, written from its wire
format as the connector's docs state it, not from the crate's code. Used by
tests/side_channel_attacker.rs.

The wire: each frame is a 4-byte big-endian length, then a MessagePack body. A request or
answer is a map of one key, the variant's name, to its fields:
  reader: {"Hello": {"nonce": bin32, "version": 2}}, then {"Proof": {"sealed": bin}}
  server: {"Challenge": {"nonce": bin32, "version": 2}}, then {"Proven": {"sealed": bin}}
          (or {"Refused"|"Busy"|"Unauthenticated": {"reason": str}})
Sealing: HKDF-SHA256 with salt b"nixl-connector side channel v2" + reader nonce + server
nonce over the shared secret, info the role's label, 32 bytes; ChaCha20-Poly1305 with a nonce
of 12 zero bytes and the role's label as associated data. The reader seals its handshake
message (a MessagePack map); the server seals {"Accepted": message} or {"Refused": {...}}.

Usage (every result is one JSON line on stdout, after "@@ "):
  attacker.py relay PORT TARGET_PORT MODE   MODE: honest | tamper-proof | tamper-answer.
      Relays connections to 127.0.0.1:TARGET_PORT until stdin closes, printing
      {"port": P} at start and one line per frame: direction, size, hex.
  attacker.py prove PORT SECRET MESSAGE_HEX
      Handshakes as a reader with the secret and the handshake message MESSAGE_HEX,
      replacing nothing; prints the server's answer: {"agent_name", "agent_metadata"} or
      {"error"}.
  attacker.py storm PORT SECONDS
      Garbage of every kind on fresh connections for SECONDS; prints {"connections": n}.
"""

import json
import os
import random
import socket
import struct
import sys
import threading
import time

import msgspec
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

LABEL = b"nixl-connector side channel v2"
READER = b"nixl-connector side channel v2: reader"
SERVER = b"nixl-connector side channel v2: server"
VERSION = 2


def say(obj):
    print("@@", json.dumps(obj), flush=True)


def send_frame(sock, body):
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_exact(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError("closed")
        out += chunk
    return out


def recv_frame(sock):
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    return recv_exact(sock, n)


def key(secret, reader, server, role):
    salt = LABEL + reader + server
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=role).derive(secret)


def relay(port, target, mode):
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(16)
    say({"port": listener.getsockname()[1]})
    lock = threading.Lock()

    def pump(src, dst, direction):
        try:
            while True:
                body = recv_frame(src)
                with lock:
                    say({"direction": direction, "size": len(body), "hex": body.hex()})
                decoded = msgspec.msgpack.decode(body)
                kind = next(iter(decoded)) if isinstance(decoded, dict) else None
                if (mode, kind) in (("tamper-proof", "Proof"), ("tamper-answer", "Proven")):
                    body = body[:-1] + bytes([body[-1] ^ 1])
                send_frame(dst, body)
        except (EOFError, OSError, msgspec.DecodeError):
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def accept():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", target))
            for args in ((client, upstream, "to_server"), (upstream, client, "to_reader")):
                threading.Thread(target=pump, args=args, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()
    listener.close()


def prove(port, secret, message):
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    reader = os.urandom(32)
    send_frame(sock, msgspec.msgpack.encode({"Hello": {"nonce": reader, "version": VERSION}}))
    answer = msgspec.msgpack.decode(recv_frame(sock))
    if "Challenge" not in answer:
        return say({"error": answer})
    server = answer["Challenge"]["nonce"]
    sealed = ChaCha20Poly1305(key(secret, reader, server, READER)).encrypt(
        bytes(12), message, READER
    )
    send_frame(sock, msgspec.msgpack.encode({"Proof": {"sealed": sealed}}))
    answer = msgspec.msgpack.decode(recv_frame(sock))
    if "Proven" not in answer:
        return say({"error": answer})
    opened = ChaCha20Poly1305(key(secret, reader, server, SERVER)).decrypt(
        bytes(12), answer["Proven"]["sealed"], SERVER
    )
    inner = msgspec.msgpack.decode(opened)
    if "Accepted" not in inner:
        return say({"error": inner})
    theirs = inner["Accepted"]
    say({"agent_name": theirs["agent_name"], "agent_metadata": bytes(theirs["agent_metadata"]).hex()})


def storm(port, seconds):
    rng = random.Random(7)
    garbage = [
        lambda: os.urandom(rng.randrange(1, 200)),
        lambda: struct.pack(">I", 1 << 31),
        lambda: struct.pack(">I", 9) + os.urandom(9),
        lambda: frame({"Hello": {"nonce": os.urandom(32), "version": 1}}),
        lambda: frame({"Hello": {"nonce": os.urandom(32)}}),
        lambda: frame({"Hello": {"nonce": os.urandom(3), "version": VERSION}}),
        lambda: frame({"Proof": {"sealed": os.urandom(64)}}),
        lambda: frame({"Handshake": {"protocol_version": 4}}),
    ]
    count = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
            pick = garbage[count % len(garbage)]
            sock.sendall(pick())
            if count % len(garbage) == 5 or count % len(garbage) == 6:
                # After a challenge, a proof that opens under no key.
                try:
                    recv_frame(sock)
                    sock.sendall(frame({"Proof": {"sealed": os.urandom(80)}}))
                    recv_frame(sock)
                except (EOFError, OSError):
                    pass
            sock.close()
        except OSError:
            pass
        count += 1
    say({"connections": count})


def frame(obj):
    body = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(body)) + body


def main():
    cmd, *args = sys.argv[1:]
    if cmd == "relay":
        relay(int(args[0]), int(args[1]), args[2])
    elif cmd == "prove":
        prove(int(args[0]), args[1].encode(), bytes.fromhex(args[2]))
    elif cmd == "storm":
        storm(int(args[0]), float(args[1]))
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
