"""Fuzz child without validation: loads each input of a batch file (u32 little-endian
length + bytes, repeated) with NIXL's official Python API, printing the input's index
before trying it. Used by `fuzz_metadata --target python` to show what the inputs do to
an unguarded NIXL. Usage: load_each.py BATCH_FILE
"""

import struct
import sys

from nixl_cu12 import nixl_agent


def main():
    batch = open(sys.argv[1], "rb").read()
    pos, index, agent = 0, 0, None
    while pos + 4 <= len(batch):
        (size,) = struct.unpack_from("<I", batch, pos)
        data = batch[pos + 4 : pos + 4 + size]
        pos += 4 + size
        print(index, flush=True)
        agent = nixl_agent(f"fuzz-py-loader-{index}")
        try:
            agent.add_remote_agent(data)
            print("reached-nixl", flush=True)
        except Exception:
            print("reached-nixl", flush=True)
        index += 1
    print("done", flush=True)


if __name__ == "__main__":
    main()
