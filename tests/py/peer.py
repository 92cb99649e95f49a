"""A NIXL agent made with NIXL's official Python API, driven line by line over stdin.

Used by tests/python_interop.rs. Usage: peer.py AGENT_NAME BUFFER_BYTES

At start it registers BUFFER_BYTES of DRAM filled with (i * 7 + 3) % 256 and prints one
JSON line: its metadata of every kind (hex) and the buffer's address and length. Then each
command line gets one answer line. Answer lines start with "@@ " (NIXL logs to stdout too):
  load HEX                 add_remote_agent(bytes) -> the remote agent's name
  notify AGENT HEX         send_notif(AGENT, bytes) -> ok
  wait_notif AGENT         first notification from AGENT -> HEX
  dump                     the buffer -> HEX
  quit
"""

import json
import sys
import time

import numpy as np
from nixl_cu12 import _bindings, nixl_agent


def main():
    name, size = sys.argv[1], int(sys.argv[2])
    agent = nixl_agent(name)
    buf = ((np.arange(size, dtype=np.uint64) * 7 + 3) % 256).astype(np.uint8)
    addr = buf.ctypes.data
    reg = agent.get_reg_descs([(addr, size, 0, "")], "DRAM")
    agent.register_memory(reg)
    empty = _bindings.nixlRegDList(agent.nixl_mems["DRAM"], [])
    out = {
        "full": agent.get_agent_metadata().hex(),
        "partial_conn": agent.get_partial_agent_metadata(reg, True, ["UCX"]).hex(),
        "partial": agent.get_partial_agent_metadata(reg, False, ["UCX"]).hex(),
        "conn": agent.get_partial_agent_metadata(empty, True, []).hex(),
        "addr": addr,
        "len": size,
    }
    print("@@", json.dumps(out), flush=True)
    pending = {}
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "load":
            name = agent.add_remote_agent(bytes.fromhex(args[0]))
            print("@@", name.decode() if isinstance(name, bytes) else name, flush=True)
        elif cmd == "notify":
            agent.send_notif(args[0], bytes.fromhex(args[1]))
            print("@@ ok", flush=True)
        elif cmd == "wait_notif":
            deadline = time.monotonic() + 60
            while not pending.get(args[0]) and time.monotonic() < deadline:
                for sender, notes in agent.get_new_notifs().items():
                    pending.setdefault(sender, []).extend(notes)
                time.sleep(0.001)
            notes = pending.get(args[0]) or [b"timeout"]
            print("@@", notes.pop(0).hex(), flush=True)
        elif cmd == "dump":
            print("@@", buf.tobytes().hex(), flush=True)
        elif cmd == "quit":
            break


if __name__ == "__main__":
    main()
