/* ps_table.c - the model's tensor table as bytes (ps_table.h). */
#include "ps_table.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "psd.pb-c.h"

int ps_table_pack(const ps_layout_t *l, uint8_t **buf, size_t *len)
{
    Psd__TensorTable tt = PSD__TENSOR_TABLE__INIT;
    const int n = ps_layout_ntab(l);
    Psd__TensorSpec *specs = calloc((size_t)n, sizeof *specs), **sp = calloc((size_t)n, sizeof *sp);
    uint64_t(*shapes)[PS_MAX_DIMS] = calloc((size_t)n, sizeof *shapes);
    int rc = -1;
    if (!specs || !sp || !shapes) goto out;
    for (int t = 0; t < n; t++) {
        const ps_tensor_info_t *ti = ps_layout_tensor(l, t);
        psd__tensor_spec__init(&specs[t]);
        specs[t].name = (char *)ti->name;
        memcpy(shapes[t], ti->shape, sizeof shapes[t]);
        specs[t].shape = shapes[t];
        specs[t].n_shape = (size_t)ti->ndim;
        specs[t].sparse_rows = ti->kind == PS_TENSOR_ROWS;
        sp[t] = &specs[t];
    }
    tt.tensors = sp;
    tt.n_tensors = (size_t)n;
    *len = psd__tensor_table__get_packed_size(&tt);
    if (!(*buf = malloc(*len ? *len : 1))) goto out;
    psd__tensor_table__pack(&tt, *buf);
    rc = 0;
out:
    free(specs);
    free(sp);
    free(shapes);
    return rc;
}

int ps_table_unpack(const uint8_t *buf, size_t len, ps_layout_t *l, char *err, size_t errlen)
{
    Psd__TensorTable *tt = psd__tensor_table__unpack(NULL, len, buf);
    if (!tt) {
        snprintf(err, errlen, "the tensor table does not decode");
        return -1;
    }
    int rc = -1;
    ps_tensor_spec_t *sp = NULL;
    if (tt->n_tensors < 1 || tt->n_tensors > PS_MAX_TABLE) {
        snprintf(err, errlen, "a table of %zu tensors (1 to %d)", tt->n_tensors, PS_MAX_TABLE);
        goto out;
    }
    if (!(sp = calloc(tt->n_tensors, sizeof *sp))) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < tt->n_tensors; i++) {
        const Psd__TensorSpec *t = tt->tensors[i];
        if (!t->name || strlen(t->name) > PS_NAME_MAX || t->n_shape > PS_MAX_DIMS) {
            snprintf(err, errlen, "tensor %zu: a name over %d bytes or over %d dimensions", i, PS_NAME_MAX,
                     PS_MAX_DIMS);
            goto out;
        }
        snprintf(sp[i].name, sizeof sp[i].name, "%s", t->name);
        sp[i].ndim = (int)t->n_shape;
        if (t->n_shape) memcpy(sp[i].shape, t->shape, t->n_shape * sizeof *t->shape);
        sp[i].kind = t->sparse_rows ? PS_TENSOR_ROWS : PS_TENSOR_DENSE;
        sp[i].init.kind = PS_INIT_ZEROS;
    }
    rc = ps_layout_init_specs(l, sp, (int)tt->n_tensors, err, errlen);
out:
    free(sp);
    psd__tensor_table__free_unpacked(tt, NULL);
    return rc;
}
