/* fuzz_config - the YAML config loader, flag setter and validator
 * (common/ps_config.c).
 *
 * 1. ps_config_defaults, ps_config_load_string(input), ps_config_validate.
 *    The config must be unchanged when loading fails. When it succeeds, the
 *    YAML ps_config_write_yaml prints must load back to the same config (its
 *    documented contract): written again it gives the same text.
 * 2. ps_config_set with the input split at the first '=' (key=value), then
 *    ps_config_validate.
 *
 * (The round trip found NEL/LS/PS and C1 controls, U+FFFE/U+FFFF written
 * unescaped, fixed in 493280d and 71bb5f5: corpus/fuzz_config/
 * nel-roundtrip.yaml, c1-control-roundtrip.yaml, fffe-roundtrip.yaml.) */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "ps_config.h"

static char *yaml_text(const ps_config_t *c, size_t *len)
{
    char *text = NULL;
    *len = 0;
    FILE *f = open_memstream(&text, len);
    if (!f) FUZZ_DIE("open_memstream");
    if (ps_config_write_yaml(c, f) != 0) FUZZ_DIE("ps_config_write_yaml failed");
    if (fclose(f) != 0) FUZZ_DIE("fclose memstream");
    return text;
}

static void check_roundtrip(const ps_config_t *c)
{
    size_t len1, len2;
    char *t1 = yaml_text(c, &len1);
    ps_config_t back;
    char err[512];
    ps_config_defaults(&back);
    if (ps_config_load_string(&back, t1, len1, "written", err, sizeof err) != 0) {
        fprintf(stderr, "---- written YAML ----\n%s---- reading it back: %s\n", t1, err);
        FUZZ_DIE("ps_config_write_yaml output does not load back");
    }
    char *t2 = yaml_text(&back, &len2);
    if (len1 != len2 || memcmp(t1, t2, len1) != 0) {
        fprintf(stderr, "---- written ----\n%s---- read back and written again ----\n%s", t1, t2);
        FUZZ_DIE("ps_config_write_yaml output reads back to a different config");
    }
    if (ps_config_hash(c) != ps_config_hash(&back)) FUZZ_DIE("hash differs after round trip");
    free(t1);
    free(t2);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512];
    ps_config_t c, before;

    /* 1. YAML */
    ps_config_defaults(&c);
    memcpy(&before, &c, sizeof c);
    int rc = ps_config_load_string(&c, (const char *)data, size, "fuzz.yaml", err, sizeof err);
    if (rc == 0) {
        (void)ps_config_validate(&c, err, sizeof err);
        (void)ps_config_hash(&c);
        check_roundtrip(&c);
    } else {
        if (!memchr(err, '\0', sizeof err) || err[0] == '\0') FUZZ_DIE("load error without a message");
        if (memcmp(&c, &before, sizeof c) != 0) FUZZ_DIE("failed load changed the config");
    }

    /* 2. key=value, as a command-line flag */
    char *s = malloc(size + 1);
    if (!s) return 0;
    memcpy(s, data, size);
    s[size] = '\0';
    char *eq = memchr(s, '=', size);
    const char *key = s, *value = "";
    if (eq) {
        *eq = '\0';
        value = eq + 1;
    }
    ps_config_defaults(&c);
    memcpy(&before, &c, sizeof c);
    if (ps_config_set(&c, key, value, err, sizeof err) == 0) {
        (void)ps_config_validate(&c, err, sizeof err);
        (void)ps_config_hash(&c);
    } else if (memcmp(&c, &before, sizeof c) != 0) {
        FUZZ_DIE("failed ps_config_set changed the config");
    }
    free(s);
    return 0;
}
