"""psd: Python workers for the psd parameter server.

psd.torch turns a PyTorch training loop into a psd worker (psd.torch.Worker).
The protocol is the C worker library's (libpsworker.so.3), reached through
ctypes: nothing here is compiled, and any Python 3 with ctypes can use it.
The library is found through PSD_WORKER_LIB, in build/ next to the source
tree's package (PYTHONPATH=python), where meson installed it, or the
linker's search path.
"""
__version__ = "0.1.0"
