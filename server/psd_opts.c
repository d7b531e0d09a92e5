/* psd_opts.c - the decisions every psd shard takes alike (see psd_opts.h). */
#include "psd_opts.h"

#include "ps_util.h"

bool psd_table_on_psd(const ps_config_t *c, const ps_layout_t *l, bool lazy)
{
    /* one table only: replies replace one frame by rows (l->table's); the
     * click-through model only, whose validation rows psd knows (psd_step_range_rows_send) */
    return c->kind == PS_MODEL_CTR && l->table >= 0 && ps_layout_sparse_units(l) == 1 && lazy && (double)l->t[l->table].numel * 4.0 / 1048576.0 > c->ctr_worker_table_mb &&
           c->wire_weights == PS_WIRE_F32 && c->wire_gradients == PS_WIRE_F32;
}

int psd_ckpt_keep(const ps_config_t *c, int shards) { return shards > 1 && c->ckpt_keep < 2 ? 2 : c->ckpt_keep; }

/* Threads are sized by the CPUs psd may use (ps_cpus_usable: its affinity
 * mask and cgroup quota), not the host's: psd bound to 4 cores of a 64-core
 * node runs 4 step threads, not 16. */
int psd_step_threads(const ps_config_t *c)
{
    if (c->threads > 0) return c->threads;
    int cores = ps_cpus_usable(NULL, NULL);
    return cores > 16 ? 16 : cores;
}

