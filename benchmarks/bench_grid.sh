# Shared by the run_*.sh grids (sourced, not run): one resumable `nsd bench` call per named
# run, with the grid's common arguments in COMMON and its results folder in OUT.
NSD=${NSD:-.venv/bin/nsd}

run() {
    local name=$1; shift
    echo "== $name: $NSD bench ${COMMON[*]} $* --out $OUT/$name" >&2
    "$NSD" bench "${COMMON[@]}" "$@" --rerun-loaded --out "$OUT/$name"
}
