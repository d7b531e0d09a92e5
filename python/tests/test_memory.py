"""psw_keep_freed_memory, as psd.torch.Worker calls it: in a Python process, a
large block freed by a thread (as ZeroMQ's I/O thread frees each message) is the
next one's with its pages, where glibc's defaults map it fresh and fault in
every page. Each case in a fresh interpreter (the setting is process-wide)."""
import os
import subprocess
import sys

CHILD = r"""
import ctypes, resource, sys, threading
from psd import _lib
if sys.argv[1] == "keep":
    _lib.load().psw_keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
BLOCK, out = 80 << 20, []

def rounds():
    before = 0
    for r in range(4):
        if r == 1:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(BLOCK)
        assert p
        ctypes.memset(p, r + 1, BLOCK)
        libc.free(p)
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

t = threading.Thread(target=rounds)
t.start()
t.join()
print(out[0])
"""


def faults(mode):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


def test_kept_memory_takes_no_page_fault_for_the_next_large_message():
    pages = 3 * (80 << 20) // 4096  # 3 rounds of an 80 MiB block: 61,440 pages
    kept, plain = faults("keep"), faults("plain")
    assert kept < 2000, "%d page faults with the memory kept" % kept
    assert plain > pages // 2, "%d page faults with glibc's defaults (the control)" % plain
