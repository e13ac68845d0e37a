"""Stand-ins for ``worker.export.llama_child`` run as ``python -m``: ``crash`` dereferences
NULL (a real SIGSEGV, as a mis-built llama.cpp does), ``hang`` never answers."""
import ctypes
import json
import sys
import time

if __name__ == "__main__":
    req = json.loads(sys.stdin.read())
    if req["op"] == "crash":
        ctypes.string_at(0)
    time.sleep(120)
