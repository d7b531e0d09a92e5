#!/bin/bash
# shellcheck disable=SC2016  # regexes and sed scripts hold a literal $ and backquotes
# docs/config.md against the key table of common/ps_config.c: no build needed.
#
#   bash tests/config_doc.sh SOURCE_ROOT [--strict]
#
# Every entry of the table `static const key_spec_t keys[] = { ... };` (the K_INT,
# K_DOUBLE, K_BOOL, K_STRING, K_ENUM... macros and the literal {.key = ...} entries)
# names a key; docs/config.md documents a key as one table row starting with
# "| `section.key` |", its default in the next cell. Exits 1 naming each key of the
# table missing from the doc, each documented key not in the table, and each key
# documented twice; 0 otherwise. A documented default that differs from the table's
# is printed as a warning, and fails too with --strict.
set -euo pipefail

ROOT=${1:?usage: config_doc.sh SOURCE_ROOT [--strict]}
STRICT=0
[ "${2:-}" = --strict ] && STRICT=1
SRC=$ROOT/common/ps_config.c
DOC=$ROOT/docs/config.md
for f in "$SRC" "$DOC"; do
    [ -r "$f" ] || { echo "config_doc: cannot read $f" >&2; exit 2; }
done

# The table as "key<TAB>default" lines. Entries may span lines: join until the
# line that closes the entry (")," or "},"); skip comments; expand a string macro
# (FMNIST "file") from its #define.
table=$(awk '
    /^#define [A-Z_][A-Z0-9_]* "[^"]*"/ { v = $3; gsub(/"/, "", v); macro[$2] = v }
    /^static const key_spec_t keys\[\] = \{/ { on = 1; next }
    on && /^\};/ { on = 0 }
    !on { next }
    {
        line = $0
        sub(/\/\*.*\*\//, "", line)            # a comment on the line
        if (line ~ /^[ \t]*(\/\*|\*)/) next     # a comment of its own
        if (line ~ /^[ \t]*$/) next
        entry = entry " " line
        # the entry ends where its brackets close (string contents aside)
        t = line; gsub(/"[^"]*"/, "", t)
        depth += gsub(/[({]/, "", t); t2 = line; gsub(/"[^"]*"/, "", t2); depth -= gsub(/[)}]/, "", t2)
        if (depth > 0) next
        depth = 0
        e = entry; entry = ""
        if (match(e, /(K_[A-Z0-9]+\(|\.key = )"[^"]+"/) == 0) { print "?\t" e; next }
        k = substr(e, RSTART, RLENGTH); sub(/^[^"]*"/, "", k); sub(/"$/, "", k)
        d = ""
        if (match(e, /\.def = "[^"]*"/)) {
            d = substr(e, RSTART, RLENGTH); sub(/^\.def = "/, "", d); sub(/"$/, "", d)
        } else {
            # the last argument: [MACRO] "text" before the closing ")"
            t = e; sub(/\)[ \t]*,[ \t]*$/, "", t)
            if (match(t, /([A-Z_][A-Z0-9_]*[ \t]+)?"[^"]*"[ \t]*$/)) {
                a = substr(t, RSTART, RLENGTH)
                if (match(a, /^[A-Z_][A-Z0-9_]*/)) { m = substr(a, 1, RLENGTH); pre = macro[m] } else pre = ""
                sub(/^[^"]*"/, "", a); sub(/"[ \t]*$/, "", a)
                d = pre a
            }
        }
        print k "\t" d
    }' "$SRC")

if [ -z "$table" ]; then
    echo "config_doc: no keys found in $SRC (has the key table moved?)" >&2
    exit 2
fi
if grep -q '^?' <<<"$table"; then
    echo "config_doc: entries of the key table without a key name:" >&2
    grep '^?' <<<"$table" >&2
    exit 2
fi

# The doc's rows: | `key` | default | meaning |
doc=$(sed -nE 's/^\| `([a-z0-9_]+\.[a-z0-9_.]+)` \| *([^|]*[^| ]) *\|.*/\1\t\2/p' "$DOC" |
    awk -F'\t' '{ d = $2; gsub(/`/, "", d); if (d == "\"\"") d = ""; print $1 "\t" d }')

fail=0
tkeys=$(cut -f1 <<<"$table" | sort)
dkeys=$(cut -f1 <<<"$doc" | sort)
while read -r k; do
    [ -n "$k" ] || continue
    echo "config_doc: key in common/ps_config.c but not in docs/config.md: $k"
    fail=1
done < <(comm -23 <(sort -u <<<"$tkeys") <(sort -u <<<"$dkeys"))
while read -r k; do
    [ -n "$k" ] || continue
    echo "config_doc: key in docs/config.md but not in common/ps_config.c: $k"
    fail=1
done < <(comm -13 <(sort -u <<<"$tkeys") <(sort -u <<<"$dkeys"))
while read -r k; do
    [ -n "$k" ] || continue
    echo "config_doc: key documented more than once in docs/config.md: $k"
    fail=1
done < <(uniq -d <<<"$dkeys")

# Defaults, as the table spells them.
while IFS=$'\t' read -r k d; do
    dd=$(awk -F'\t' -v k="$k" '$1 == k { print $2; exit }' <<<"$doc")
    if ! grep -q "^$k"$'\t' <<<"$doc"; then continue; fi
    if [ "$dd" != "$d" ]; then
        echo "config_doc: $( [ $STRICT = 1 ] && echo error || echo warning ): $k: default '$d' in the table, '$dd' in docs/config.md"
        [ $STRICT = 1 ] && fail=1
    fi
done <<<"$table"

n=$(wc -l <<<"$table")
if [ $fail -ne 0 ]; then
    echo "config_doc: FAIL: docs/config.md and the key table of common/ps_config.c ($n keys) differ"
    exit 1
fi
echo "config_doc: ok: docs/config.md documents the $n keys of common/ps_config.c's key table"
