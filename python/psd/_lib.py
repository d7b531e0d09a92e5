"""ctypes mirror of worker/include/psworker.h (libpsworker.so.3).

The C library is the one implementation of psd's protocol; this module only
declares its structs and functions. Each struct's size is checked against
the library's own (psw_struct_size) when the library is loaded, so a
mirror that drifted from the header fails at import, not in a run.
"""
import ctypes
import ctypes.util
import os

NAME_MAX = 255
MAX_DIMS = 8
MAX_LAYERS = 16
PATH_MAX = 1024
OFFER_CONFIG_MAX = 16384  # PSW_OFFER_CONFIG_MAX: the offered optimizer and schedule's YAML, bytes
MAX_SUMS = 16

EV_EPOCH, EV_WEIGHTS, EV_VALIDATE, EV_SHUTDOWN = 1, 2, 3, 4
SPLIT_TEST, SPLIT_VAL = 0, 1
MODEL_MLP, MODEL_CTR, MODEL_TENSORS = 0, 1, 2

c_float_p = ctypes.POINTER(ctypes.c_float)
c_u32_p = ctypes.POINTER(ctypes.c_uint32)


class Tensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * (NAME_MAX + 1)), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_uint64 * MAX_DIMS), ("numel", ctypes.c_uint64),
                ("sparse_rows", ctypes.c_int), ("offset", ctypes.c_uint64)]


class Info(ctypes.Structure):
    _fields_ = [("device", ctypes.c_char_p), ("device_index", ctypes.c_int),
                ("identity_hint", ctypes.c_char_p), ("threads", ctypes.c_uint), ("protocol", ctypes.c_uint),
                ("run_id", ctypes.c_uint64), ("prev_rank", ctypes.c_uint32),
                ("curve_public", ctypes.c_char_p), ("curve_secret", ctypes.c_char_p),
                ("curve_server", ctypes.c_char_p), ("identity", ctypes.c_void_p), ("identity_len", ctypes.c_size_t),
                ("no_shm", ctypes.c_int), ("n_offer", ctypes.c_int), ("offer", ctypes.POINTER(Tensor)),
                ("offer_values", ctypes.POINTER(c_float_p))]


class File(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char * 32), ("path", ctypes.c_char * PATH_MAX), ("size", ctypes.c_uint64),
                ("hash", ctypes.c_uint64)]


class Ctr(ctypes.Structure):
    _fields_ = [("fields", ctypes.c_int), ("per_field", ctypes.c_int), ("dim", ctypes.c_int), ("mean", ctypes.c_int),
                ("vocab", ctypes.c_uint64), ("rows", ctypes.c_uint64), ("seed", ctypes.c_uint64),
                ("train", ctypes.c_uint64), ("test", ctypes.c_uint64), ("zipf", ctypes.c_double),
                ("weight_std", ctypes.c_double), ("bias", ctypes.c_double), ("table_on_psd", ctypes.c_int)]


class Assign(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_uint32), ("run_id", ctypes.c_uint64), ("model", ctypes.c_int),
                ("n_tensors", ctypes.c_int), ("tensors", ctypes.POINTER(Tensor)), ("n_sizes", ctypes.c_int),
                ("sizes", ctypes.c_int * (MAX_LAYERS + 1)), ("n_files", ctypes.c_int), ("files", File * 4),
                ("batch_size", ctypes.c_uint32), ("val_batch_size", ctypes.c_uint32),
                ("norm_mean", ctypes.c_double), ("norm_std", ctypes.c_double), ("train_limit", ctypes.c_uint64),
                ("epochs", ctypes.c_uint32), ("seed", ctypes.c_uint64), ("sync", ctypes.c_uint32),
                ("staleness", ctypes.c_uint32), ("sparse_threshold", ctypes.c_double),
                ("start_timeout_s", ctypes.c_double), ("step_timeout_s", ctypes.c_double),
                ("silence_s", ctypes.c_double), ("shm", ctypes.c_int), ("stream", ctypes.c_int), ("ctr", Ctr),
                ("world", ctypes.c_uint32)]


class Sum(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_double)]


class Val(ctypes.Structure):
    _fields_ = [("epoch", ctypes.c_uint32), ("version", ctypes.c_uint64), ("begin", ctypes.c_uint64),
                ("split", ctypes.c_int), ("loss_sum", ctypes.c_double), ("correct", ctypes.c_uint64),
                ("count", ctypes.c_uint64), ("scores", c_float_p), ("n_sums", ctypes.c_int),
                ("sums", ctypes.POINTER(Sum))]


class Event(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("epoch", ctypes.c_uint32), ("version", ctypes.c_uint64),
                ("step", ctypes.c_uint64), ("world", ctypes.c_uint32), ("workers_on_host", ctypes.c_uint32),
                ("samples", c_u32_p), ("n_samples", ctypes.c_size_t), ("append", ctypes.c_int),
                ("keep", ctypes.c_uint64), ("n_tensors", ctypes.c_int), ("tensors", ctypes.POINTER(c_float_p)),
                ("tensor_numel", ctypes.POINTER(ctypes.c_size_t)), ("val_begin", ctypes.c_uint64),
                ("val_end", ctypes.c_uint64), ("split", ctypes.c_int), ("val_ids", c_u32_p),
                ("n_val_ids", ctypes.c_size_t), ("final", ctypes.c_int), ("row_ids", c_u32_p),
                ("n_row_ids", ctypes.c_size_t), ("exit_code", ctypes.c_int), ("message", ctypes.c_char * 256),
                ("has_last_val", ctypes.c_int), ("last_val", Val), ("last_val_final", ctypes.c_int)]


class Grad(ctypes.Structure):
    _fields_ = [("tensor", ctypes.c_uint32), ("data", c_float_p), ("row_ids", c_u32_p), ("n_rows", ctypes.c_size_t),
                ("row_vals", c_float_p)]


class Push(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint64), ("batch", ctypes.c_uint32), ("loss_sum", ctypes.c_double),
                ("correct", ctypes.c_uint64), ("pull", ctypes.c_int), ("n_grads", ctypes.c_int),
                ("grads", ctypes.POINTER(Grad)), ("want", c_u32_p), ("n_want", ctypes.c_size_t)]


class CtrGen(ctypes.Structure):
    _fields_ = [("fields", ctypes.c_int), ("per_field", ctypes.c_int), ("vocab", ctypes.c_uint64),
                ("zipf", ctypes.c_double), ("rows", ctypes.c_uint64), ("weight_std", ctypes.c_double),
                ("bias", ctypes.c_double), ("seed", ctypes.c_uint64)]


_STRUCTS = {"psw_ctr_gen_t": CtrGen,
            "psw_tensor_t": Tensor, "psw_info_t": Info, "psw_file_t": File, "psw_assign_t": Assign,
            "psw_event_t": Event, "psw_grad_t": Grad, "psw_push_t": Push, "psw_sum_t": Sum, "psw_val_t": Val}


def _candidates():
    env = os.environ.get("PSD_WORKER_LIB")
    if env:
        yield env
        return
    # the source tree's package (PYTHONPATH=python) next to a build in build/
    tree = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "build", "libpsworker.so.3")
    if os.path.exists(tree):
        yield os.path.normpath(tree)
    try:  # written by meson install: where it put the library
        from . import _installed
        yield os.path.join(_installed.LIBDIR, "libpsworker.so.3")
    except ImportError:
        pass
    found = ctypes.util.find_library("psworker")
    if found:
        yield found
    yield "libpsworker.so.3"


def _declare(lib):
    c = ctypes
    sig = {
        "psw_client_new": (c.c_void_p, [c.c_char_p, c.POINTER(Info), c.c_char_p, c.c_size_t]),
        "psw_client_destroy": (None, [c.POINTER(c.c_void_p)]),
        "psw_client_register": (c.c_int, [c.c_void_p, c.POINTER(Assign), c.c_double, c.c_char_p, c.c_size_t]),
        "psw_client_offer_config": (c.c_int, [c.c_void_p, c.c_char_p, c.c_char_p, c.c_size_t]),
        "psw_client_shutdown_code": (c.c_int, [c.c_void_p]),
        "psw_client_ready": (c.c_int, [c.c_void_p, c.c_uint64, c.c_uint64, c.c_char_p]),
        "psw_client_next": (c.c_int, [c.c_void_p, c.POINTER(Event), c.c_double, c.c_char_p, c.c_size_t]),
        "psw_client_pull": (c.c_int, [c.c_void_p, c.c_uint64]),
        "psw_client_push_v": (c.c_int, [c.c_void_p, c.POINTER(Push)]),
        "psw_client_push_done": (c.c_int, [c.c_void_p]),
        "psw_client_push_wait": (c.c_int, [c.c_void_p, c.c_double]),
        "psw_client_barrier": (c.c_int, [c.c_void_p, c.c_uint32, c.c_uint64]),
        "psw_client_val_result": (c.c_int, [c.c_void_p, c.POINTER(Val)]),
        "psw_client_heartbeat": (c.c_int, [c.c_void_p, c.c_uint32]),
        "psw_client_leave": (c.c_int, [c.c_void_p, c.c_char_p]),
        "psw_client_end_run": (c.c_int, [c.c_void_p, c.c_char_p]),
        "psw_client_fail": (c.c_int, [c.c_void_p, c.c_int, c.c_char_p]),
        "psw_client_rank": (c.c_uint32, [c.c_void_p]),
        "psw_client_run_id": (c.c_uint64, [c.c_void_p]),
        "psw_client_push_region": (c.c_void_p, [c.c_void_p]),
        "psw_client_release_on_push": (None, [c.c_void_p, c.c_int]),
        "psw_make_identity": (None, [c.c_char_p, c.c_uint64]),
        "psw_keep_freed_memory": (None, []),
        "psw_struct_size": (c.c_size_t, [c.c_char_p]),
        "psw_client_rows_ok": (c.c_int, [c.c_void_p]),
        "psw_client_wire_bf16": (None, [c.c_void_p, c.POINTER(c.c_int), c.POINTER(c.c_int)]),
        "psw_client_bf16_given": (None, [c.c_void_p, c.c_int]),
        "psw_client_weights_bf16": (c.c_void_p, [c.c_void_p]),
        "psw_load_keys": (c.c_int, [c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p, c.c_char_p,
                                    c.c_size_t]),
        "psw_ctr_examples": (c.c_int, [c.POINTER(CtrGen), c.POINTER(c.c_uint64), c.c_size_t, c_u32_p,
                                       c.POINTER(c.c_uint8), c.POINTER(c.c_double), c.c_char_p, c.c_size_t]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


_lib = None


def load():
    """The worker library, loaded once, its structs checked against this mirror."""
    global _lib
    if _lib is not None:
        return _lib
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)  # CDLL: the GIL is released during each call
            _declare(lib)
        except (OSError, AttributeError) as e:
            errors.append("%s: %s" % (path, e))
            continue
        for name, cls in _STRUCTS.items():
            want = lib.psw_struct_size(name.encode())
            if want != ctypes.sizeof(cls):
                raise ImportError("psd: %s is %d bytes in %s but %d in this binding: the library and the Python "
                                  "package are of different versions" % (name, want, path, ctypes.sizeof(cls)))
        _lib = lib
        return lib
    raise ImportError("psd: cannot load the worker library libpsworker.so.3 (set PSD_WORKER_LIB to its path): "
                      + "; ".join(errors))
