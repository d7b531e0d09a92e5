/* psd_status.c - what psd shows of its run (see psd_status.h): read only. */
#include "psd_status.h"

static void fmt_duration(char *out, size_t n, double s)
{
    long t = s > 0 && s < 1e7 ? (long)(s + 0.5) : 0;
    if (t >= 3600) snprintf(out, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else snprintf(out, n, "%ld:%02ld", t / 60, t % 60);
}

/* "epoch 3/15 step 120/469 (26%) 31400 samples/s ETA 0:12 loss 0.4123
 * slowest rank 1 (12.3 ms)": where the epoch stands and who holds it up */
static void progress_text(srv_t *s, char *buf, size_t n, double now)
{
    double el = now - s->t_epoch, sps = el > 0 ? (double)s->ep.samples / el : 0;
    double left = s->spe - (double)s->epoch_step, eta = s->epoch_step ? el / (double)s->epoch_step * left : 0;
    char when[32], slow[64] = "";
    fmt_duration(when, sizeof when, eta);
    const worker_t *sw = NULL;
    int live = 0;
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        if (w->state != W_TRAIN && w->state != W_BARRIER) continue;
        live++;
        if (w->compute_ewma > 0 && (!sw || w->compute_ewma > sw->compute_ewma)) sw = w;
    }
    if (sw && live > 1) snprintf(slow, sizeof slow, " slowest rank %u (%.1f ms)", sw->rank, 1e3 * sw->compute_ewma);
    snprintf(buf, n, "epoch %u/%d step %" PRIu64 "/%.0f (%.0f%%) %.0f samples/s ETA %s loss %.4f%s", s->epoch + 1,
             s->cfg.epochs, s->epoch_step, s->spe, 100.0 * (double)s->epoch_step / s->spe, sps,
             s->epoch_step ? when : "?", s->last_loss, slow);
}

/* On a terminal a live line (refreshed by the 100 ms timer), else a plain
 * log line every server.progress_every seconds while an epoch trains. */
void psd_status_progress(srv_t *s, double now)
{
    char line[256];
    if (s->tty) {
        if (s->phase == PHASE_TRAIN) {
            progress_text(s, line, sizeof line, now);
            ps_log_status(line);
        } else if (s->phase == PHASE_VALIDATE) {
            int done = 0;
            for (int i = 0; i < s->n_parts; i++) done += s->parts[i].done;
            snprintf(line, sizeof line, "epoch %u/%d validating: %d/%d parts", s->epoch + 1, s->cfg.epochs, done,
                     s->n_parts);
            ps_log_status(line);
        }
        return;
    }
    if (s->cfg.progress_every <= 0 || s->phase != PHASE_TRAIN) {
        s->progress_next = 0;
        return;
    }
    if (s->progress_next == 0) s->progress_next = now + s->cfg.progress_every; /* not at the epoch's start */
    if (now < s->progress_next) return;
    s->progress_next = now + s->cfg.progress_every;
    progress_text(s, line, sizeof line, now);
    PS_INFO("%s", line);
}

static const char *phase_name(phase_t p)
{
    static const char *n[] = {"waiting", "training", "validating", "done"};
    return n[p];
}

static void metric(FILE *f, const char *name, const char *type, const char *help, double v)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    if (isnan(v)) fprintf(f, "%s NaN\n", name); /* the exposition format's spelling */
    else fprintf(f, "%s %.17g\n", name, v);
}

static void histogram(FILE *f, const srv_t *s, const char *name, const char *help, bool wait)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        const psd_hist_t *hist = wait ? &w->h_wait : &w->h_compute;
        const uint64_t *h = hist->n;
        uint64_t cum = 0;
        for (int b = 0; b <= PSD_HIST_N; b++) {
            cum += h[b];
            if (b < PSD_HIST_N) fprintf(f, "%s_bucket{rank=\"%u\",le=\"%g\"} %" PRIu64 "\n", name, w->rank, psd_hist_le[b], cum);
            else fprintf(f, "%s_bucket{rank=\"%u\",le=\"+Inf\"} %" PRIu64 "\n", name, w->rank, cum);
        }
        fprintf(f, "%s_sum{rank=\"%u\"} %.9g\n%s_count{rank=\"%u\"} %" PRIu64 "\n", name, w->rank,
                hist->sum, name, w->rank, cum);
    }
}

static double epoch_sps(const srv_t *s, double now)
{
    if (s->phase != PHASE_TRAIN) return s->t_epoch > 0 && s->phase == PHASE_VALIDATE ? (double)s->ep.samples / s->t_epoch : 0;
    double el = now - s->t_epoch;
    return el > 0 ? (double)s->ep.samples / el : 0;
}

static void render_metrics(srv_t *s, FILE *f)
{
    double now = ps_now();
    int live = live_workers(s);
    metric(f, "psd_info", "gauge", "psd's run: 1 (labels in /status)", 1);
    metric(f, "psd_steps_total", "counter", "Optimizer steps applied in the run.", (double)s->step);
    metric(f, "psd_steps_in_place_total", "counter",
           "Versions made by updating the current parameters in place (nothing referenced them).",
           (double)s->store.in_place);
    metric(f, "psd_epoch", "gauge", "Epoch in progress, 1-based.", s->epoch + 1);
    metric(f, "psd_epochs", "gauge", "Epochs the run trains.", s->cfg.epochs);
    metric(f, "psd_epoch_progress_ratio", "gauge", "Part of the epoch's steps done.",
           s->spe > 0 ? (double)s->epoch_step / s->spe : 0);
    metric(f, "psd_train_loss", "gauge", "Mean training loss of the last step.", s->last_loss);
    metric(f, "psd_train_samples_total", "counter", "Training samples trained on in the run.",
           (double)(s->samples_total + (s->phase == PHASE_TRAIN ? s->ep.samples : 0)));
    metric(f, "psd_samples_per_second", "gauge", "Training samples per second in this epoch.", epoch_sps(s, now));
    metric(f, "psd_val_accuracy", "gauge", "Validation accuracy of the last validated epoch (NaN before one).",
           s->val_epoch_last ? s->val_acc_last : NAN);
    metric(f, "psd_val_loss", "gauge", "Validation loss of the last validated epoch (NaN before one).",
           s->val_epoch_last ? s->val_loss_last : NAN);
    if (s->vl.n_sums > 0) { /* the workers' named sums, as means per sample */
        fprintf(f, "# HELP psd_val_mean The workers' named validation sums of the last validated epoch, per sample.\n"
                   "# TYPE psd_val_mean gauge\n");
        for (int j = 0; j < s->vl.n_sums; j++)
            fprintf(f, "psd_val_mean{name=\"%s\"} %.17g\n", s->vl.names[j],
                    s->val_epoch_last ? s->vl.last_means[j] : NAN);
    }
    if (psd_best_on(&s->vl.keep))
        metric(f, "psd_best_epoch", "gauge", "The best epoch so far by train.keep_best.metric (0: none yet).",
               s->vl.keep.has ? s->vl.keep.epoch : 0);
    metric(f, "psd_wire_received_bytes_total", "counter", "Tensor bytes received on the wire.",
           (double)(s->bytes_in_done + s->ep.bytes_in));
    metric(f, "psd_wire_sent_bytes_total", "counter", "Tensor bytes sent on the wire.",
           (double)(s->bytes_out_done + s->ep.bytes_out));
    metric(f, "psd_workers_live", "gauge", "Workers taking part in the run.", live);
    metric(f, "psd_workers_lost_total", "counter", "Workers lost (connection closed, or silent) in the run.",
           (double)s->ended[WEND_LOST]);
    metric(f, "psd_workers_failed_total", "counter", "Workers that failed (their own error) in the run.",
           (double)s->ended[WEND_FAILED]);
    metric(f, "psd_workers_left_total", "counter", "Workers that left the run (e.g. SIGTERM).",
           (double)s->ended[WEND_LEFT]);
    metric(f, "psd_workers_refused_total", "counter", "Workers whose run psd ended for a message it could not take.",
           (double)s->ended[WEND_REFUSED]);
    metric(f, "psd_shards", "gauge", "psd shards holding the parameters.", s->sh.n);
    if (s->cfg.sync != PS_SYNC_BSP) {
        metric(f, "psd_staleness_max", "gauge",
               "Most versions between a gradient's weights and the version it was applied to, this epoch.",
               (double)s->ep.stale_max);
        metric(f, "psd_staleness_mean", "gauge", "Mean staleness of the gradients applied this epoch (versions).",
               stale_mean(s));
    }
    metric(f, "psd_checkpoints_total", "counter", "Checkpoints written in this process.", (double)s->ck.written);
    metric(f, "psd_checkpoint_age_seconds", "gauge", "Seconds since the last checkpoint was written (NaN: none yet).",
           s->ck.last_t > 0 ? now - s->ck.last_t : NAN);
    fprintf(f, "# HELP psd_worker_up A worker of the run: 1 while it takes part.\n# TYPE psd_worker_up gauge\n");
    for (int i = 0; i < s->n; i++)
        fprintf(f, "psd_worker_up{rank=\"%u\",state=\"%s\"} %d\n", s->w[i].rank, psd_wstate_name[s->w[i].state],
                s->w[i].state >= W_READY && s->w[i].state <= W_VALIDATED);
    histogram(f, s, "psd_worker_pull_wait_seconds",
              "Per worker: from asking for weights to receiving them (push, psd's step, the other workers).", true);
    histogram(f, s, "psd_worker_compute_seconds", "Per worker: from receiving weights to pushing the gradient.", false);
    fprintf(f, "# HELP psd_worker_barrier_wait_seconds_total Per worker: time spent waiting at epoch barriers.\n"
               "# TYPE psd_worker_barrier_wait_seconds_total counter\n");
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        double b = w->barrier_wait_s + (w->state == W_BARRIER && w->barrier_at > 0 ? now - w->barrier_at : 0);
        fprintf(f, "psd_worker_barrier_wait_seconds_total{rank=\"%u\"} %.9g\n", w->rank, b);
    }
}

static void json_str(FILE *f, const char *v)
{
    char buf[512];
    ps_json_escape(buf, sizeof buf, v);
    fprintf(f, "\"%s\"", buf);
}

static void json_num(FILE *f, double v) /* JSON has no NaN: null */
{
    if (isfinite(v)) fprintf(f, "%.9g", v);
    else fputs("null", f);
}

/* The run's optimizer and schedule keys: {"optimizer.lr": {"value": "0.001", "from": "worker"}, ...} (the
 * values as --print-config writes them; from: config, worker or default). */
static void render_optimizer(const srv_t *s, FILE *f)
{
    const char *key;
    int n = 0;
    fputc('{', f);
    for (size_t i = 0; (key = ps_config_key(i)); i++) {
        if (strncmp(key, "optimizer.", 10) != 0 && strncmp(key, "schedule.", 9) != 0) continue;
        char v[2200], esc[4500];
        ps_config_value_text(&s->cfg, key, v, sizeof v);
        ps_json_escape(esc, sizeof esc, v);
        fprintf(f, "%s\"%s\":{\"value\":\"%s\",\"from\":\"%s\"}", n++ ? "," : "", key, esc,
                ps_from_name(ps_config_from(&s->cfg, key)));
    }
    fputc('}', f);
}

void psd_status_json(const srv_t *s, FILE *f)
{
    double now = ps_now();
    fprintf(f, "{\"version\":\"%s\",\"protocol\":%u,\"run_id\":\"%016" PRIx64 "\",\"phase\":\"%s\"", PSD_VERSION,
            PS_PROTOCOL_VERSION, s->run_id, phase_name(s->phase));
    fprintf(f, ",\"epoch\":%u,\"epochs\":%d,\"step\":%" PRIu64 ",\"epoch_step\":%" PRIu64 ",\"steps_per_epoch\":",
            s->epoch + 1, s->cfg.epochs, s->step, s->epoch_step);
    json_num(f, s->spe);
    fputs(",\"train_loss\":", f);
    json_num(f, s->last_loss);
    fputs(",\"samples_per_s\":", f);
    json_num(f, epoch_sps(s, now));
    fprintf(f, ",\"val_epoch\":%u,\"val_acc\":", s->val_epoch_last);
    json_num(f, s->val_epoch_last ? s->val_acc_last : NAN);
    fputs(",\"val_loss\":", f);
    json_num(f, s->val_epoch_last ? s->val_loss_last : NAN);
    fputs(",\"val_means\":{", f);
    for (int j = 0; j < s->vl.n_sums; j++) {
        fprintf(f, "%s\"%s\":", j ? "," : "", s->vl.names[j]);
        json_num(f, s->val_epoch_last ? s->vl.last_means[j] : NAN);
    }
    fprintf(f, "},\"val_set\":\"%s\",\"best_epoch\":%u,\"stopped_early\":%s", s->vl.n_val ? "held_out" : "test",
            s->vl.keep.has ? s->vl.keep.epoch : 0, s->vl.stopped_early ? "true" : "false");
    fprintf(f, ",\"lr\":");
    json_num(f, s->lr);
    fprintf(f, ",\"wire_bytes_in\":%" PRIu64 ",\"wire_bytes_out\":%" PRIu64 ",\"checkpoints\":%" PRIu64
               ",\"checkpoint_age_s\":",
            s->bytes_in_done + s->ep.bytes_in, s->bytes_out_done + s->ep.bytes_out, s->ck.written);
    json_num(f, s->ck.last_t > 0 ? now - s->ck.last_t : NAN);
    fprintf(f, ",\"uptime_s\":%.3f,\"workers_live\":%d", now - s->t_boot, live_workers(s));
    for (int k = WEND_LEFT; k < WEND_N; k++) fprintf(f, ",\"workers_%s\":%" PRIu64, psd_wend_name[k], s->ended[k]);
    fprintf(f, ",\"workers\":[");
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        fprintf(f, "%s{\"rank\":%u,\"host\":", i ? "," : "", w->rank);
        json_str(f, w->hostname);
        fprintf(f, ",\"pid\":%u,\"device\":", w->pid);
        json_str(f, w->device);
        fprintf(f, ",\"state\":\"%s\"", psd_wstate_name[w->state]);
        if (w->state == W_GONE && w->end != WEND_NONE) fprintf(f, ",\"ended\":\"%s\"", psd_wend_name[w->end]);
        fprintf(f, ",\"compute_ms\":");
        json_num(f, 1e3 * w->compute_ewma);
        uint64_t steps = psd_hist_count(&w->h_wait);
        fprintf(f, ",\"steps\":%" PRIu64 ",\"wait_ms_mean\":", steps);
        json_num(f, steps ? 1e3 * w->h_wait.sum / (double)steps : NAN);
        fprintf(f, ",\"samples\":%" PRIu64 ",\"assigned\":%" PRIu64 "}", w->share.consumed, w->share.assigned);
    }
    fprintf(f, "],\"config\":{\"layers\":[");
    for (int i = 0; i < s->cfg.n_sizes; i++) fprintf(f, "%s%d", i ? "," : "", s->cfg.sizes[i]);
    fprintf(f, "],\"params\":%zu,\"optimizer\":\"%s\",\"lr\":", s->layout.n_params, ps_opt_name(s->cfg.opt));
    json_num(f, s->cfg.lr);
    fprintf(f, ",\"schedule\":\"%s\",\"batch_size\":%d,\"workers\":%d,\"shards\":%d,\"seed\":%" PRIu64
               ",\"train_samples\":%zu,\"val_samples\":%zu,\"test_samples\":%zu,\"sync\":\"%s\","
               "\"staleness\":%d},\"optimizer\":",
            ps_sched_name(s->cfg.sched), s->cfg.batch_size, s->cfg.workers, s->sh.n, (uint64_t)s->cfg.seed,
            s->train_count, s->vl.n_val, s->test_count, ps_sync_name(s->cfg.sync), s->cfg.staleness);
    render_optimizer(s, f);
    fputs("}\n", f);
}


int psd_status_http(void *ud, const char *path, char **body, size_t *len, const char **ctype)
{
    srv_t *s = ud;
    FILE *f = open_memstream(body, len);
    if (!f) return 500;
    int code = 200;
    if (strcmp(path, "/metrics") == 0) {
        *ctype = "text/plain; version=0.0.4; charset=utf-8";
        render_metrics(s, f);
    } else if (strcmp(path, "/status") == 0) {
        *ctype = "application/json";
        psd_status_json(s, f);
    } else if (strcmp(path, "/history") == 0) {
        *ctype = "application/json";
        fputs("{\"loss\":[", f);
        for (int i = 0; i < s->n_curve; i++)
            fprintf(f, "%s[%" PRIu64 ",%.6g]", i ? "," : "", s->curve[i].step,
                    isfinite(s->curve[i].loss) ? (double)s->curve[i].loss : 0.0);
        fputs("],\"epochs\":[", f);
        for (int i = 0; i < s->n_val_curve; i++)
            fprintf(f, "%s{\"epoch\":%u,\"step\":%" PRIu64 ",\"train_loss\":%.6g,\"val_loss\":%.6g,\"val_acc\":%.6g}",
                    i ? "," : "", s->val_curve[i].epoch, s->val_curve[i].step, (double)s->val_curve[i].train_loss,
                    (double)s->val_curve[i].val_loss, (double)s->val_curve[i].val_acc);
        fputs("]}\n", f);
    } else if (strcmp(path, "/") == 0 || strcmp(path, "/index.html") == 0) {
        *ctype = "text/html; charset=utf-8";
        fwrite(psd_page_html, 1, psd_page_html_len, f);
    } else if (strcmp(path, "/healthz") == 0) {
        fputs(s->phase == PHASE_DONE ? "done\n" : "ok\n", f);
    } else {
        code = 404;
        fputs("not found: /, /metrics, /status, /history, /healthz\n", f);
    }
    if (fclose(f) != 0) {
        free(*body);
        *body = NULL;
        return 500;
    }
    return code;
}

/* status and workers for people */
void psd_status_human(const srv_t *s, FILE *f, bool workers_only)
{
    double now = ps_now();
    if (!workers_only) {
        fprintf(f, "psd %s run %016" PRIx64 ": %s, epoch %u/%d, step %" PRIu64 " (%" PRIu64 "/%.0f in the epoch)\n",
                PSD_VERSION, s->run_id, phase_name(s->phase), s->epoch + 1, s->cfg.epochs, s->step, s->epoch_step,
                s->spe);
        fprintf(f, "train loss %.4f, %.0f samples/s", s->last_loss, epoch_sps(s, now));
        if (s->val_epoch_last) fprintf(f, ", val_acc %.4f after epoch %u", s->val_acc_last, s->val_epoch_last);
        fprintf(f, "\nworkers %d live, %" PRIu64 " lost, %" PRIu64 " failed, %" PRIu64 " left, %" PRIu64
                   " refused; shards %d; checkpoints %" PRIu64, live_workers(s), s->ended[WEND_LOST],
                s->ended[WEND_FAILED], s->ended[WEND_LEFT], s->ended[WEND_REFUSED], s->sh.n, s->ck.written);
        if (s->ck.last_t > 0) fprintf(f, " (last %.0f s ago)", now - s->ck.last_t);
        fputc('\n', f);
        if (s->cfg.sync != PS_SYNC_BSP) {
            fprintf(f, "%s", ps_sync_name(s->cfg.sync));
            if (s->cfg.sync == PS_SYNC_SSP) fprintf(f, " (staleness bound %d)", s->cfg.staleness);
            fprintf(f, ": staleness this epoch max %" PRIu64 ", mean %.2f versions\n", s->ep.stale_max,
                    stale_mean(s));
        }
    }
    fprintf(f, "%-5s %-20s %-8s %-10s %-11s %10s %10s %12s\n", "rank", "host", "pid", "device", "state", "compute",
            "wait", "samples");
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        uint64_t steps = psd_hist_count(&w->h_wait);
        fprintf(f, "%-5u %-20.20s %-8u %-10.10s %-11s %8.1fms %8.1fms %5" PRIu64 "/%-6" PRIu64 "\n", w->rank,
                w->hostname, w->pid, w->device, psd_wstate_name[w->state], 1e3 * w->compute_ewma,
                steps ? 1e3 * w->h_wait.sum / (double)steps : 0.0, w->share.consumed, w->share.assigned);
    }
}
