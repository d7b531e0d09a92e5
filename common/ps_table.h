/* ps_table.h - the model's tensor table as bytes: a packed psd.TensorTable
 * (proto/psd.proto), the form it has in ASSIGN's frame (protocol 7) and in
 * checkpoints of format 5. Names, shapes and kinds travel; inits do not
 * (psd draws the initial values, workers receive them). */
#ifndef PS_TABLE_H
#define PS_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "ps_model.h"

/* l's table packed into a new buffer (*buf, *len; caller frees). 0, or -1
 * when out of memory. */
int ps_table_pack(const ps_layout_t *l, uint8_t **buf, size_t *len);
/* A layout from packed bytes, checked as ps_layout_init_specs checks a
 * config's (a hostile peer or file gets a message, nothing else). 0, or -1
 * with why. */
int ps_table_unpack(const uint8_t *buf, size_t len, ps_layout_t *l, char *err, size_t errlen);

#endif
