#!/bin/bash
# shellcheck disable=SC2016  # regexes and sed scripts hold a literal $ and backquotes
# Every command in the README's code blocks is run by a named test, or is marked as
# needing hardware these machines lack. No build needed.
#
#   bash tests/readme_cmds.sh SOURCE_ROOT [--strict]
#
# Code blocks: fenced ```sh / ```shell / ```bash / ```console blocks, and blocks
# indented by 4 spaces (the README's two set-up commands). A command is a line of
# such a block (lines ending in "\" joined), its prompt ("host-a$ ") and trailing
# "# comment" taken off; comment-only lines are skipped.
#
# For each command the script prints the test that covers it, found
#   1. in the table below: an extended regex the command matches, the test (meson
#      test name, and the Criterion case or step), and evidence: FILE:REGEX pairs
#      that must all match (so a renamed or removed test turns the entry stale,
#      which fails here too);
#   2. else, for `cd DIR`: DIR exists in the source tree (nothing to run);
#   3. else, by grep: a test file (tests/*.c, tests/*.sh, tests/deploy/*.sh,
#      deploy/*.sh, .ci/*) holding the command's program and every one of its
#      --flags;
#   4. else a hardware mark in the command's comment, "(needs ...)", e.g.
#      "# GPU workers (needs an NVIDIA GPU)".
# Exits 1 when a command has none of these, or a table entry's evidence is missing.
# Entries made with `parts` name a command no test runs as written but whose every
# step a test runs; they pass, are listed at the end, and fail with --strict.
set -euo pipefail

ROOT=${1:?usage: readme_cmds.sh SOURCE_ROOT [--strict]}
STRICT=0
[ "${2:-}" = --strict ] && STRICT=1
cd "$ROOT"
README=README.md
[ -r "$README" ] || { echo "readme_cmds: no $ROOT/README.md" >&2; exit 2; }

# ---------------------------------------------------------------- the table
# map REGEX TEST EVIDENCE...   (EVIDENCE: FILE:REGEX, grep -E)
PAT=() TST=() EVD=() KIND=()
map() { PAT+=("$1"); TST+=("$2"); shift 2; local IFS=$'\n'; EVD+=("$*"); KIND+=(test); }
parts() { map "$@"; KIND[-1]=parts; }

map '^sh deploy/quickstart\.sh test$' \
    '.ci/run, step 1 (CI): runs it as written, then every meson suite' \
    '.ci/run:^sh deploy/quickstart\.sh test$'
map '^sh deploy/quickstart\.sh train$' \
    'deploy: quickstart-train runs it as written (one epoch, a free port: PSD_PORT, --epochs 1)' \
    'tests/deploy/quickstart_train.sh:sh deploy/quickstart\.sh train --epochs 1' \
    'tests/meson.build:test\('"'"'quickstart-train'"'"
map '^\.venv/bin/python examples/lightning/fit\.py --epochs 2 --out runs/single$' \
    'lightning: test_the_examples_readme_commands_psd_within_2_percent_of_the_single_trainer runs it as written' \
    'python/tests/test_lightning.py:py = "\.venv/bin/python"' \
    'python/tests/test_lightning.py:\[py, "examples/lightning/fit\.py"\] \+ single_args \+ \["--out", "runs/" \+ out\]' \
    'python/tests/test_lightning.py:single_and_psd\(\["--epochs", "2"\], \["lightning", "--epochs", "2"\], "single"' \
    'meson.build:suite : '"'"'lightning'"'"
map '^sh deploy/quickstart\.sh lightning --epochs 2$' \
    'lightning: the same test runs it as written (a free port: PSD_PORT)' \
    'python/tests/test_lightning.py:\["sh", "deploy/quickstart\.sh"\] \+ quickstart_args'
map '^\.venv/bin/python examples/lightning/fit\.py --model weather --out runs/wsingle$' \
    'lightning: test_the_weather_forecasters_readme_commands_psd_within_2_percent_of_the_single_trainer runs it as written' \
    'python/tests/test_lightning.py:\[py, "examples/lightning/fit\.py"\] \+ single_args \+ \["--out", "runs/" \+ out\]' \
    'python/tests/test_lightning.py:single_and_psd\(\["--model", "weather"\], \["weather"\], "wsingle"'
map '^sh deploy/quickstart\.sh weather$' \
    'lightning: the same test runs it as written (a free port: PSD_PORT)' \
    'python/tests/test_lightning.py:\["sh", "deploy/quickstart\.sh"\] \+ quickstart_args'
map '^\.venv/bin/python examples/ignite/autoencoder\.py --epochs 3 --train-limit 12000 --out runs/single$' \
    'ignite: test_the_readmes_commands_psd_within_2_percent_of_the_single_process runs it as written' \
    'python/tests/test_ignite.py:py = "\.venv/bin/python"' \
    'python/tests/test_ignite.py:args = \["--epochs", "3", "--train-limit", "12000"\]' \
    'python/tests/test_ignite.py:\[py, "examples/ignite/autoencoder\.py", \*args, "--out", "runs/single"\]' \
    'meson.build:suite : '"'"'ignite'"'"
map '^sh deploy/quickstart\.sh ignite --epochs 3 --train-limit 12000$' \
    'ignite: the same test runs it as written (a free port: PSD_PORT)' \
    'python/tests/test_ignite.py:\["sh", "deploy/quickstart.sh", "ignite", \*args\]'
map '^sh deploy/quickstart\.sh torch$' \
    'python: test_quickstart_torch_runs_as_written runs it as written (one epoch of 3,000 samples, a free port)' \
    'python/tests/test_torch.py:"deploy/quickstart.sh", "torch"' \
    'meson.build:suite : '"'"'python'"'"
map '^build/psd --workers [0-9]+ --listen tcp://127\.0\.0\.1:[0-9]+$' \
    'integration: every short/ test starts psd so (tests/itest.c start_psd), e.g. short/two_workers_count_every_test_sample; deploy-docker: the run by hand' \
    'tests/itest.c:psd_bin, "--listen", r->endpoint, "--workers"' \
    'tests/test_integration.c:Test\(short, two_workers_count_every_test_sample\)' \
    'tests/deploy/docker.sh:--listen "tcp://127\.0\.0\.1:\$PORT" --workers 2'
map '^build/pworker --connect tcp://127\.0\.0\.1:[0-9]+$' \
    'integration: every short/ test starts its workers so (tests/itest.c start_worker), e.g. short/two_workers_count_every_test_sample; deploy-docker: the run by hand' \
    'tests/itest.c:pworker_bin, "--connect", r->endpoint' \
    'tests/deploy/docker.sh:pworker" --connect "tcp://127\.0\.0\.1:\$PORT"'
map '^\./fm_worker tcp://127\.0\.0\.1:[0-9]+ & \./fm_worker tcp://127\.0\.0\.1:[0-9]+$' \
    'unit: example-c starts two of them so, built against the installed library (tests/example_c.sh)' \
    'tests/example_c.sh:"\$T/fm_worker" "tcp://127\.0\.0\.1:\$port"' \
    'tests/meson.build:test\('"'"'example-c'"'"
map '^build/psd eval [^ ]+$' \
    'integration: short/eval_of_saved_weights_matches_validation (tests/test_integration.c)' \
    'tests/test_integration.c:Test\(short, eval_of_saved_weights_matches_validation\)' \
    'tests/test_integration.c:%s. eval .%s'
map '^psd keygen [^ ]+$' \
    'integration: short/keygen_writes_a_private_secret_key (tests/it_auth.c)' \
    'tests/it_auth.c:Test\(short, keygen_writes_a_private_secret_key\)' \
    'tests/it_auth.c:%s. keygen %s'
map '^mkdir allow && cp [^ ]+\.pub( [^ ]+\.pub)* allow/$' \
    'integration: short/only_allow_listed_keys_get_in (tests/it_auth.c auth_setup, on 127.0.0.1)' \
    'tests/it_auth.c:Test\(short, only_allow_listed_keys_get_in\)' \
    'tests/it_auth.c:mkdir -p .%s/allow' \
    'tests/it_auth.c:cp .%s/%s\.pub. .%s/allow/'
map '^psd --workers [0-9]+ --key [^ ]+ --allow [^ ]+$' \
    'integration: short/only_allow_listed_keys_get_in (tests/it_auth.c, on 127.0.0.1)' \
    'tests/it_auth.c:Test\(short, only_allow_listed_keys_get_in\)' \
    'tests/it_auth.c:"--key", key, "--allow", allow'
map '^pworker --connect tcp://[^ ]+ --key [^ ]+ --server-key [^ ]+$' \
    'integration: short/only_allow_listed_keys_get_in (tests/it_auth.c keyed_worker, on 127.0.0.1)' \
    'tests/it_auth.c:Test\(short, only_allow_listed_keys_get_in\)' \
    'tests/it_auth.c:argv\[n\+\+\] = "--server-key"'
map '^docker-compose up --build --scale pworker=[0-9]+$' \
    'deploy-docker (tests/deploy/docker.sh): builds deploy/docker/Dockerfile, then docker-compose up --scale pworker=2' \
    'tests/meson.build:test\('"'"'deploy-docker'"'"'' \
    'tests/deploy/docker.sh:docker build -f "\$SRC/deploy/docker/Dockerfile"' \
    'tests/deploy/docker.sh:up --no-build --scale pworker=2'
map '^PSD_WORKERS=[0-9]+ PSD_ARGS="[^"]*" docker-compose up --build --scale pworker=[0-9]+$' \
    'deploy-docker (tests/deploy/docker.sh): PSD_WORKERS=2 PSD_ARGS="--epochs 2 --seed 7", up --scale pworker=2' \
    'tests/deploy/docker.sh:export PSD_IMAGE=\$IMAGE PSD_WORKERS=2' \
    'tests/deploy/docker.sh:PSD_ARGS="--epochs \$EPOCHS' \
    'tests/deploy/docker.sh:up --no-build --scale pworker=2'
map '^docker-compose run --rm --no-deps pworker ' \
    'deploy-docker (tests/deploy/docker.sh): docker-compose run --rm --no-deps pworker, reading /var/lib/psd' \
    'tests/deploy/docker.sh:run --rm --no-deps --entrypoint stat pworker'
map '^PSD_TORCH=1 PSD_CONFIG_FILE=[^ ]+ PSD_WORKER_CMD="[^"]+" +docker-compose up --build --scale pworker=2' \
    'deploy-docker (tests/deploy/docker.sh): step 5, the image built with TORCH=1, fashion_cnn.py as 2 compose workers' \
    'tests/deploy/docker.sh:--build-arg TORCH=1' \
    'tests/deploy/docker.sh:PSD_CONFIG_FILE=\$SRC/examples/torch/fashion_cnn\.yaml' \
    'tests/deploy/docker.sh:PSD_WORKER_CMD="python3 fashion_cnn\.py"'
map '^sbatch .* : .*deploy/slurm/psd-het\.sbatch$' \
    'deploy-slurm (tests/deploy/slurm.sh): psd-het.sbatch, a heterogeneous job with 2 worker tasks' \
    'tests/meson.build:test\('"'"'deploy-slurm'"'"'' \
    'tests/deploy/slurm.sh:submit het "\$P_HET" : --ntasks=2 "\$ROOT/deploy/slurm/psd-het\.sbatch"'
map '^sbatch --nodes=[0-9]+ --ntasks-per-node=[0-9]+ .*deploy/slurm/psd-nodes\.sbatch$' \
    'deploy-slurm (tests/deploy/slurm.sh): psd-nodes.sbatch on 2 nodes' \
    'tests/deploy/slurm.sh:--nodes=2 --ntasks-per-node=1 "\$ROOT/deploy/slurm/psd-nodes\.sbatch"'
map '^PSD_ARGS="[^"]*" sbatch deploy/slurm/psd-het\.sbatch$' \
    'deploy-slurm (tests/deploy/slurm.sh): every job is submitted with PSD_ARGS' \
    'tests/deploy/slurm.sh:PSD_ARGS="\$\{SUBMIT_PSD_ARGS:-\$\{PSD_RUN_ARGS\[\*\]\}\}"' \
    'tests/deploy/slurm.sh:deploy/slurm/psd-het\.sbatch'
map '^PSD_CONFIG=[^ ]+ PSD_WORKER_CMD="[^"]+" +sbatch : --ntasks=2 deploy/slurm/psd-het\.sbatch' \
    'deploy-slurm (tests/deploy/slurm.sh): step 5, PSD_WORKER_CMD: 2 fashion_cnn.py workers as the het job'"'"'s tasks' \
    'tests/deploy/slurm.sh:PSD_WORKER_CMD="/usr/bin/python3 \$ROOT/examples/torch/fashion_cnn\.py' \
    'tests/deploy/slurm.sh:PSD_CONFIG="\$ROOT/examples/torch/fashion_cnn\.yaml"'
map '^build/pworker --connect [^ ]+ --devices auto$' \
    'integration: short/devices_auto_without_gpu_trains_on_cpu_with_one_warning (tests/it_client.c), short/gpu_workers_train_like_cpu_workers_on_the_cuda_emulator (tests/it_gpu.c, 2 emulated GPUs)' \
    'tests/it_client.c:Test\(short, devices_auto_without_gpu_trains_on_cpu_with_one_warning\)' \
    'tests/it_gpu.c:Test\(short, gpu_workers_train_like_cpu_workers_on_the_cuda_emulator\)' \
    'tests/it_gpu.c:"auto"'
map '^build/psd --workers [0-9]+ --listen [^ ]+ --stop-after-epoch [0-9]+$' \
    'integration: short/stopped_at_an_epoch_boundary_and_resumed_gives_identical_weights (tests/it_faults.c)' \
    'tests/it_faults.c:Test\(short, stopped_at_an_epoch_boundary_and_resumed_gives_identical_weights\)' \
    'tests/it_faults.c:"--stop-after-epoch", "2"'
map '^build/psd --workers [0-9]+ --listen [^ ]+ --resume [^ ]+$' \
    'integration: short/stopped_at_an_epoch_boundary_and_resumed_gives_identical_weights, short/killed_psd_resumes_and_the_same_workers_carry_on (tests/it_faults.c)' \
    'tests/it_faults.c:Test\(short, killed_psd_resumes_and_the_same_workers_carry_on\)' \
    'tests/it_faults.c:"--resume", dirbuf'
map '^build/psd --workers [0-9]+ --listen [^ ]+ --http [^ ]+$' \
    'integration: short/http_metrics_status_and_healthz (tests/it_http.c)' \
    'tests/it_http.c:Test\(short, http_metrics_status_and_healthz\)' \
    'tests/it_http.c:"--http", addr'
map '^build/psctl (status|workers|checkpoint|stop) --server [^ ]+$' \
    'integration: short/psctl_status_checkpoint_and_stop (tests/it_http.c)' \
    'tests/it_http.c:Test\(short, psctl_status_checkpoint_and_stop\)' \
    'tests/it_http.c:status --server %s'

# ---------------------------------------------------------------- the commands
# "LINE<TAB>COMMAND<TAB>COMMENT" for every command line of the README's code blocks
commands() {
    awk '
    function emit(n, text,    c, cm, i, q, ch) {
        # the comment: from the first " #" outside quotes
        c = text; cm = ""; q = ""
        for (i = 1; i <= length(text); i++) {
            ch = substr(text, i, 1)
            if (q != "") { if (ch == q) q = ""; continue }
            if (ch == "\"" || ch == "\047") { q = ch; continue }
            if (ch == "#" && (i == 1 || substr(text, i - 1, 1) ~ /[ \t]/)) {
                c = substr(text, 1, i - 1); cm = substr(text, i + 1); break
            }
        }
        sub(/^[ \t]+/, "", c); sub(/[ \t]+$/, "", c)
        sub(/^[A-Za-z0-9_.-]+\$ /, "", c)          # a prompt: host-a$
        sub(/^[ \t]+/, "", cm)
        if (c != "") print n "\t" c "\t" cm
    }
    function line(n, text) {
        if (pending != "") { text = pending " " text; n = pn; pending = "" }
        if (text ~ /\\[ \t]*$/) { sub(/\\[ \t]*$/, "", text); pending = text; pn = n; return }
        emit(n, text)
    }
    /^[ \t]*```/ {
        if (!fence) { fence = 1; lang = $0; sub(/^[ \t]*```[ \t]*/, "", lang); sh = (lang ~ /^(sh|shell|bash|console)$/) }
        else fence = 0
        ind = 0; prev = $0; next
    }
    fence { if (sh) line(NR, $0); prev = $0; next }
    /^    / {
        if (ind || (prev ~ /^[ \t]*$/ && !inlist)) { ind = 1; t = $0; sub(/^    /, "", t); line(NR, t); prev = $0; next }
    }
    /^[ \t]*$/ { ind = 0; prev = $0; next }
    {
        ind = 0
        # a list item or its continuation (indented less than a code block)
        inlist = ($0 ~ /^[ \t]*([-*+]|[0-9]+\.)[ \t]/ || ($0 ~ /^  [^ ]/ && inlist))
        prev = $0
    }' "$README"
}

# ---------------------------------------------------------------- checks
TESTFILES=(tests/*.c tests/*.sh tests/deploy/*.sh deploy/*.sh .ci/*)

evidence_ok() { # the table entry i: every FILE:REGEX matches; prints what is missing
    local i=$1 e f r ok=0
    while IFS= read -r e; do
        [ -n "$e" ] || continue
        f=${e%%:*}
        r=${e#*:}
        if [ ! -r "$f" ] || ! grep -qE -- "$r" "$f"; then
            echo "      stale table entry: no /$r/ in $f"
            ok=1
        fi
    done <<<"${EVD[$i]}"
    return $ok
}

by_grep() { # a test file holding the program and all its --flags
    local cmd=$1 w prog="" flags=() f hit
    for w in $cmd; do
        if [ -z "$prog" ]; then
            [[ $w =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] && continue # VAR=value
            prog=${w##*/}
            continue
        fi
        [[ $w == --* ]] && flags+=("${w%%=*}")
    done
    [ -n "$prog" ] && [ ${#flags[@]} -gt 0 ] || return 1
    for f in "${TESTFILES[@]}"; do
        [ -f "$f" ] || continue
        case $f in tests/readme_cmds.sh | tests/config_doc.sh) continue ;; esac # not tests
        grep -qwF -- "$prog" "$f" || continue
        hit=1
        for w in "${flags[@]}"; do
            grep -qE -- "(^|[^A-Za-z0-9-])$w([^A-Za-z0-9-]|\$)" "$f" || { hit=0; break; }
        done
        [ $hit = 1 ] && { echo "$f"; return 0; }
    done
    return 1
}

n=0 ok=0 hw=0 bad=0 npart=0
partlist=()
while IFS=$'\t' read -r ln cmd comment; do
    n=$((n + 1))
    echo "README.md:$ln: $cmd"
    found=""
    for i in "${!PAT[@]}"; do
        if [[ $cmd =~ ${PAT[$i]} ]]; then
            if evidence_ok "$i"; then
                if [ "${KIND[$i]}" = parts ]; then
                    echo "    covered ${TST[$i]}"
                    npart=$((npart + 1))
                    partlist+=("README.md:$ln: $cmd")
                else
                    echo "    covered by ${TST[$i]}"
                fi
                found=1
            else
                found=stale
            fi
            break
        fi
    done
    if [ -z "$found" ] && [[ $cmd =~ ^cd\ ([^ ]+)$ ]]; then
        if [ -d "${BASH_REMATCH[1]}" ]; then
            echo "    nothing to run: changes into ${BASH_REMATCH[1]}/ (there)"
            found=1
        fi
    fi
    if [ -z "$found" ] && f=$(by_grep "$cmd"); then
        echo "    covered by $f (found by grep: its program and every flag)"
        found=1
    fi
    if [ -z "$found" ] && [[ $comment =~ \((needs [^\)]*)\) ]]; then
        echo "    not run here: ${BASH_REMATCH[1]}"
        hw=$((hw + 1))
        continue
    fi
    if [ "$found" = 1 ]; then
        ok=$((ok + 1))
    else
        echo "    NOT COVERED: no test runs it and it is not marked \"(needs ...)\""
        bad=$((bad + 1))
    fi
done < <(commands)

echo
echo "readme_cmds: $n commands: $ok run by tests, $hw need hardware these machines lack, $bad not covered"
if [ $npart -gt 0 ]; then
    echo "readme_cmds: run by tests only in parts (no test runs the command as written):"
    printf '    %s\n' "${partlist[@]}"
fi
if [ $n -eq 0 ]; then
    echo "readme_cmds: FAIL: no commands found in README.md's code blocks"
    exit 1
fi
if [ $bad -gt 0 ] || { [ $STRICT = 1 ] && [ $npart -gt 0 ]; }; then
    echo "readme_cmds: FAIL"
    exit 1
fi
echo "readme_cmds: ok"
