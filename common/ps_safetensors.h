/* ps_safetensors.h - the safetensors format (the one PyTorch and Hugging Face
 * users have their weights in): an 8-byte little-endian header length N,
 * N bytes of a JSON object
 *
 *   {"conv1.weight": {"dtype": "F32", "shape": [32, 1, 5, 5], "data_offsets": [0, 3200]},
 *    ..., "__metadata__": {"key": "value", ...}}
 *
 * (padded with spaces), then the data: each tensor's bytes, little-endian,
 * at [begin, end) of the data section, which they cover exactly, without a
 * hole or an overlap.
 *
 * The reader trusts nothing in a file: every length, offset, shape and
 * string is checked before it is used, and a file that is not one gets a
 * message saying what is wrong (fuzzed: tests/fuzz/fuzz_safetensors.c). It
 * reads F32, F16 and BF16 tensors into f32; other dtypes are named and
 * refused. The writer writes F32.
 *
 * Ownership: ps_st_file_t's arrays are its own (ps_st_free). */
#ifndef PS_SAFETENSORS_H
#define PS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define PS_ST_NAME_MAX 255       /* bytes of a tensor's name */
#define PS_ST_MAX_DIMS 8
#define PS_ST_MAX_TENSORS 65536
#define PS_ST_MAX_HEADER (100u << 20) /* the format's own bound on N */

typedef enum { PS_ST_F32 = 0, PS_ST_F16, PS_ST_BF16 } ps_st_dtype_t;

typedef struct {
    char name[PS_ST_NAME_MAX + 1];
    ps_st_dtype_t dtype;
    int ndim;
    uint64_t shape[PS_ST_MAX_DIMS];
    uint64_t numel;
    uint64_t begin, end; /* bytes of the data section */
} ps_st_tensor_t;

typedef struct {
    ps_st_tensor_t *t; /* in the order of their data */
    size_t n;
    char **meta_key, **meta_val; /* __metadata__, in the file's order */
    size_t n_meta;
    uint64_t data_off;  /* where the data section starts in the file: 8 + N */
    uint64_t data_len;
} ps_st_file_t;

/* Parse the header of a safetensors file whose first `len` bytes are buf
 * (at least its 8 + N header bytes) and whose whole size is file_size.
 * 0, or -1 with the reason in err (f is then empty). */
int ps_st_parse(const uint8_t *buf, size_t len, uint64_t file_size, ps_st_file_t *f, char *err, size_t errlen);
void ps_st_free(ps_st_file_t *f);
/* Tensor i's values as f32 into out (numel floats), from its bytes (the
 * data section's [begin, end)). */
void ps_st_to_f32(const ps_st_tensor_t *t, const uint8_t *bytes, float *out);
/* A tensor by name, or NULL. */
const ps_st_tensor_t *ps_st_find(const ps_st_file_t *f, const char *name);

/* Read a whole file: its header into f and every tensor's values as f32
 * into *values (one array, tensor i at offset sum of the numel before it;
 * caller frees; values NULL: the header only, checked against the file's
 * size). 0, or -1 with the reason in err (naming the file). */
int ps_st_load(const char *path, ps_st_file_t *f, float **values, char *err, size_t errlen);

/* One tensor to write: its name, shape and f32 values. */
typedef struct {
    const char *name;
    int ndim;
    const uint64_t *shape;
    const float *data;
} ps_st_out_t;

/* Write n tensors as F32 and n_meta metadata pairs (may be 0) to path,
 * atomically (ps_write_atomic: a temporary file synced and renamed into
 * place, the directory synced), every write checked and the
 * file synced. 0, or -1 with the reason in err. */
int ps_st_save(const char *path, const ps_st_out_t *t, size_t n, const char *const *meta_key,
               const char *const *meta_val, size_t n_meta, char *err, size_t errlen);

/* The 8-byte length and the JSON header ps_st_save writes for t (whose
 * data pointers are not read), into a new buffer (*out, *len; caller
 * frees): tensor i's data then lies at 8 + N + the sum of the sizes before
 * it. 0, or -1 with the reason. */
int ps_st_header(const ps_st_out_t *t, size_t n, const char *const *meta_key, const char *const *meta_val,
                 size_t n_meta, uint8_t **out, size_t *len, char *err, size_t errlen);

#endif
