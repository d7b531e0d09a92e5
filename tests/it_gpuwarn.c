/* it_gpuwarn.c - integration tests (see itest.h). */
#include <criterion/criterion.h>

#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itest.h"
#include "proc.h"

/* pworker --devices auto against nothing (no psd: it gives up after 1 s):
 * its log, which starts with what it found of GPUs. Caller frees. */
static char *worker_log(const char *name)
{
    char log[256];
    path(log, sizeof log, name);
    const char *argv[] = {pworker_bin, "--connect", "tcp://127.0.0.1:9", "--wait", "1", "--retry-for", "0", NULL};
    pid_t p = proc_spawn(argv, log);
    cr_assert_neq(proc_wait(p, 60), -1, "pworker ends");
    char *t = slurp(log);
    cr_assert_not_null(t, "%s", log);
    return t;
}

/* The GPU warning says what it means: on a machine without an NVIDIA
 * driver (this one, unless /proc/driver/nvidia is there), "no NVIDIA
 * driver", not CUDA's "driver version is insufficient" (error 35), which
 * reads as a broken driver. With the real CUDA backend plugin. */
Test(short, gpu_warning_says_no_nvidia_driver)
{
    if (access("/proc/driver/nvidia", F_OK) == 0) cr_skip_test("an NVIDIA driver is loaded here");
    char exe[PATH_MAX], plugin[PATH_MAX + 32];
    snprintf(exe, sizeof exe, "%s", pworker_bin);
    snprintf(plugin, sizeof plugin, "%s/libpsw_cuda.so", dirname(exe));
    if (access(plugin, F_OK) != 0) cr_skip_test("the CUDA backend plugin is not built (%s)", plugin);
    unsetenv("PSW_CUDA_PLUGIN");
    unsetenv("CUDA_VISIBLE_DEVICES");
    char *t = worker_log("nodriver.log");
    cr_log_info("%s", t);
    cr_assert_eq(count_in(t, "WARN"), 1, "one warning: %s", t);
    cr_assert(strstr(t, "no GPU found: no NVIDIA driver on this machine; training on the CPU"), "%s", t);
    cr_assert(!strstr(t, "insufficient") && !strstr(t, "error 35"), "%s", t);
    free(t);
}

/* The same on the CUDA emulator (tests/cuda_emu, any machine): no driver
 * (PSW_CUDA_EMU_DRIVER=0), a driver older than the runtime (both versions
 * named), and a driver that finds no device. */
Test(short, gpu_warning_names_driver_and_runtime_versions)
{
    const char *emu = getenv("PSD_CUDA_EMU");
    if (!emu || !*emu) cr_skip_test("no CUDA emulator plugin in this build (PSD_CUDA_EMU)");
    setenv("PSW_CUDA_PLUGIN", emu, 1);
    unsetenv("CUDA_VISIBLE_DEVICES");
    setenv("PSW_CUDA_EMU_RUNTIME", "12040", 1);

    setenv("PSW_CUDA_EMU_DRIVER", "0", 1);
    char *t = worker_log("emu-none.log");
    cr_assert(strstr(t, "no GPU found: no NVIDIA driver on this machine; training on the CPU"), "%s", t);
    cr_assert(!strstr(t, "insufficient"), "%s", t);
    free(t);

    setenv("PSW_CUDA_EMU_DRIVER", "11080", 1);
    t = worker_log("emu-old.log");
    cr_assert(strstr(t, "no GPU found: the NVIDIA driver (CUDA 11.8) is too old for this build's CUDA runtime (CUDA "
                        "12.4); training on the CPU"), "%s", t);
    cr_assert(!strstr(t, "insufficient"), "%s", t);
    free(t);

    setenv("PSW_CUDA_EMU_DRIVER", "12040", 1);
    setenv("PSW_CUDA_EMU_DEVICES", "0", 1);
    t = worker_log("emu-nodev.log");
    cr_assert(strstr(t, "no GPU found: the NVIDIA driver finds no CUDA device; training on the CPU"), "%s", t);
    free(t);
}
