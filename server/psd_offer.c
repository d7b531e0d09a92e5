/* psd_offer.c - model.kind from_worker: the model psd trains is the one the
 * first worker to register offers (its REGISTER's frame: the tensor table),
 * with its initial values (VALUES, which psd asks for with OFFER). Until
 * they come, later workers offering the same table are told to register
 * again in a moment; any worker whose table differs from the run's is
 * refused with the first difference named. Then psd_model.c sets the model
 * up, and registration goes on as for any model. */
#include "psd_core.h"
#include "ps_table.h"

/* The table a message's one DT_U8 frame holds: 1 with it in l, 0 when
 * there is no such frame, -1 when it does not decode (why). */
static int offered_table(const ps_msg_t *m, ps_layout_t *l, char *why, size_t n)
{
    if (m->n_frames != 1 || m->hdr->tensors[0]->dtype != PSD__DTYPE__DT_U8) return 0;
    return ps_table_unpack(zmq_msg_data((zmq_msg_t *)&m->frames[0]), zmq_msg_size((zmq_msg_t *)&m->frames[0]), l,
                           why, n) == 0 ? 1 : -1;
}

static void send_offer(srv_t *s, const ps_msg_t *m, bool values)
{
    Psd__Header h;
    Psd__Offer o = PSD__OFFER__INIT;
    psd_peers_hdr_for(s, NULL, &h, PSD__MSG_TYPE__MSG_OFFER);
    o.send_values = values;
    h.body_case = PSD__HEADER__BODY_OFFER;
    h.offer = &o;
    ps_msg_send(s->net.sock, m->ident, m->ident_len, &h, NULL, 0);
}

static bool refuse(srv_t *s, const ps_msg_t *m, const char *why)
{
    const Psd__Register *r = m->hdr->reg;
    PS_WARN("refused a worker from %s pid %u: %s", r->hostname && r->hostname[0] ? r->hostname : "?", r->pid, why);
    psd_peers_send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_REFUSED, why);
    return false;
}

static bool offer_table(srv_t *s, ps_msg_t *m, ps_layout_t *l, int has, char *why, size_t why_len, char *msg,
                        size_t msg_len);

/* The optimizer a REGISTER offers (Register.config), "" for none. */
static const char *offered_config(const ps_msg_t *m)
{
    const char *t = m->hdr->reg->config;
    return t ? t : "";
}

/* Whether the first worker's offered optimizer fits the run: NULL, or why
 * not (into msg). psd shards take theirs from their config: an offer that
 * would change it is refused. */
static const char *offer_misfit(srv_t *s, const char *text, char *msg, size_t n)
{
    if (!text[0]) return NULL;
    if (strlen(text) > PS_OFFER_MAX) {
        snprintf(msg, n, "the optimizer offered: %zu bytes, at most %d", strlen(text), PS_OFFER_MAX);
        return msg;
    }
    ps_config_t c = s->cfg; /* a view */
    char why[600];
    if (ps_config_adopt(&c, text, why, sizeof why) != 0) {
        snprintf(msg, n, "%s", why);
        return msg;
    }
    if (sharded(s) && ps_config_hash(&c) != s->config_hash) {
        snprintf(msg, n, "psd shards take the optimizer and schedule from their config, and this worker's code offers "
                 "another: give it in the config (optimizer.*, schedule.*), or train with one psd");
        return msg;
    }
    return NULL;
}

/* Log each optimizer and schedule key the run reads, with where its value
 * came from (config, worker, default). */
void psd_say_optimizer(const ps_config_t *c)
{
    static const char *const read[4] = {"lr momentum nesterov weight_decay", "lr beta1 beta2 eps weight_decay",
                                        "lr beta1 beta2 eps weight_decay", "lr eps weight_decay"};
    const char *key;
    for (size_t i = 0; (key = ps_config_key(i)); i++) {
        bool opt = strncmp(key, "optimizer.", 10) == 0, sch = strncmp(key, "schedule.", 9) == 0;
        if (!opt && !sch) continue;
        const char *k = key + (opt ? 10 : 9);
        if (opt && strcmp(k, "name") != 0 && strcmp(k, "clip_norm") != 0 && strcmp(k, "groups") != 0 &&
            !strstr(read[c->opt], k))
            continue;
        if (opt && strcmp(k, "groups") == 0 && c->n_groups == 0) continue;
        if (sch && strcmp(k, "name") != 0 && !(c->sched == PS_SCHED_TORCH && (strcmp(k, "torch") == 0 ||
                                                                             strcmp(k, "interval") == 0)))
            continue;
        char v[2200];
        ps_config_value_text(c, key, v, sizeof v);
        PS_INFO("%s: %s (%s)", key, v, ps_from_name(ps_config_from(c, key)));
    }
}

int psd_adopt(srv_t *s, const char *text, char *err, size_t n)
{
    if (ps_config_adopt(&s->cfg, text, err, n) != 0) return -1;
    s->config_hash = ps_config_hash(&s->cfg);
    snprintf(s->adopted, sizeof s->adopted, "%s", text);
    return 0;
}

bool psd_offer_gate(srv_t *s, ps_msg_t *m)
{
    if (s->cfg.kind != PS_MODEL_FROM_WORKER) return true;
    ps_layout_t l = {0};
    char why[400], msg[600];
    int has = offered_table(m, &l, why, sizeof why);
    bool ok = offer_table(s, m, &l, has, why, sizeof why, msg, sizeof msg);
    ps_layout_free(&l); /* kept: moved into s->offer.layout */
    return ok;
}

/* psd_offer_gate's decision on the table l (has: offered_table's) */
static bool offer_table(srv_t *s, ps_msg_t *m, ps_layout_t *l, int has, char *why, size_t why_len, char *msg,
                        size_t msg_len)
{
    if (has < 0) {
        snprintf(msg, msg_len, "the tensor table it offers: %s", why);
        return refuse(s, m, msg);
    }
    if (has == 0)
        return refuse(s, m, "this run (model.kind from_worker) trains the model its first worker offers; this worker "
                            "offers none (pworker trains the built-in models only)");
    if (s->model_ready) { /* every later worker's table is the run's */
        if (strcmp(offered_config(m), s->adopted) != 0)
            PS_WARN("a worker from %s pid %u offers another optimizer than the run's first worker did: the run's is "
                    "kept", m->hdr->reg->hostname ? m->hdr->reg->hostname : "?", m->hdr->reg->pid);
        if (ps_layout_same_table_as(l, &s->layout, "in this worker's", "in the run's", why, why_len)) return true;
        snprintf(msg, msg_len, "its model is not the run's: %s", why);
        return refuse(s, m, msg);
    }
    if ((int64_t)l->n_params > s->cfg.max_params) {
        snprintf(msg, msg_len, "its model has %zu floats, more than model.max_params (%lld)", l->n_params,
                 (long long)s->cfg.max_params);
        return refuse(s, m, msg);
    }
    const bool again = s->offer.ident_len == m->ident_len && memcmp(s->offer.ident, m->ident, m->ident_len) == 0;
    if (s->offer.ident_len && !again && ps_now() - s->offer.at < s->silence * 3 + 10) {
        /* the first worker's values are on their way: the same table waits, another is refused */
        if (!ps_layout_same_table_as(l, &s->offer.layout, "in this worker's", "in the first one's", why,
                                     why_len)) {
            snprintf(msg, msg_len, "its model is not the one the first worker offers: %s", why);
            return refuse(s, m, msg);
        }
        send_offer(s, m, false);
        return false;
    }
    if (offer_misfit(s, offered_config(m), msg, msg_len)) return refuse(s, m, msg);
    snprintf(s->offer.config, sizeof s->offer.config, "%s", offered_config(m));
    PS_INFO("a worker from %s pid %u offers the model: %d tensors, %zu parameters; asking for its values",
            m->hdr->reg->hostname ? m->hdr->reg->hostname : "?", m->hdr->reg->pid, ps_layout_ntab(l),
            ps_layout_numel(l)); /* (before its table moves) */
    ps_layout_free(&s->offer.layout);
    s->offer.layout = *l;
    l->tab = NULL; /* moved */
    memcpy(s->offer.ident, m->ident, m->ident_len);
    s->offer.ident_len = m->ident_len;
    s->offer.at = ps_now();
    send_offer(s, m, true);
    return false;
}

void psd_offer_on_values(srv_t *s, ps_msg_t *m)
{
    const ps_layout_t *l = &s->offer.layout;
    if (s->cfg.kind != PS_MODEL_FROM_WORKER || s->model_ready || s->offer.ident_len != m->ident_len ||
        memcmp(s->offer.ident, m->ident, m->ident_len) != 0) {
        psd_peers_drop(s, NULL, "VALUES from a peer psd did not ask");
        return;
    }
    if (m->n_frames != l->n_tensors) {
        psd_peers_drop(s, NULL, "VALUES of %d frames, the offered table has %d units", m->n_frames, l->n_tensors);
        return;
    }
    const float *v[PS_MAX_TENSORS];
    for (int t = 0; t < l->n_tensors; t++) {
        const Psd__TensorDesc *d = m->hdr->tensors[t];
        size_t n = 0;
        v[t] = d->id == (uint32_t)t && d->offset == 0 ? ps_msg_f32(m, t, &n) : NULL;
        if (!v[t] || n != l->t[t].numel) {
            psd_peers_drop(s, NULL, "VALUES: frame %d is not unit %s whole (%zu floats, f32)", t, l->t[t].name,
                 l->t[t].numel);
            return;
        }
    }
    char err[700];
    if (s->offer.config[0] && psd_adopt(s, s->offer.config, err, sizeof err) != 0) { /* offer_misfit took it */
        psd_peers_finish(s, PSD_EXIT_USAGE, err);
        return;
    }
    psd_say_optimizer(&s->cfg);
    s->layout = *l;
    s->offer.layout.tab = NULL; /* moved */
    int code = psd_model_setup(s, v);
    if (code != 0) {
        psd_peers_finish(s, code, "psd could not set up the model the first worker offered");
        return;
    }
    s->silence = psd_silence_limit(&s->cfg, s->layout.n_params); /* sized for max_params until now */
    PS_INFO("the model is the first worker's: %d tensors, %zu parameters; a silent worker is lost after %.1f s",
            ps_layout_ntab(&s->layout), ps_layout_numel(&s->layout), s->silence);
}
