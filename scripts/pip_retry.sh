# Sourced by scripts/test.sh and scripts/test_newest.sh.
# pip_install PYTHON ARGS...: `PYTHON -m pip install -q ARGS...`, tried up to four times with a
# growing pause between tries, because a CI machine's downloads from PyPI can break off mid-file
# (seen: torch 2.15.0's 539 MB wheel stalled at 38 MB through all six of one pip call's resumes,
# which failed the whole run). Where pip knows --resume-retries (pip >= 25.1, after the venv's
# pip upgrade), each try also resumes a broken download up to 20 times. A wheel one try finished
# stays in pip's cache, so a later try does not fetch it again.
pip_install() {
    local py="$1" try resume=()
    shift
    if "$py" -m pip install --help 2>/dev/null | grep -q -- --resume-retries; then
        resume=(--resume-retries 20)
    fi
    for try in 1 2 3 4; do
        "$py" -m pip install -q "${resume[@]}" "$@" && return 0
        [ "$try" -lt 4 ] || break
        echo "pip install $* failed (try $try of 4); trying again in $((try * 30)) s"
        sleep $((try * 30))
    done
    echo "pip install $* failed after 4 tries"
    return 1
}

# find_py312: a Python >= 3.12 (PYTHON_JAX, pyenv's 3.12.x, python3.12, python3.13, python3):
# jax 0.11, megatron-core and the newest-releases leg need it.
find_py312() {
    if [ -n "${PYTHON_JAX:-}" ]; then echo "$PYTHON_JAX"; return; fi
    if command -v pyenv >/dev/null 2>&1; then
        local p
        p="$(pyenv root)/versions/3.12.1/bin/python"
        if [ -x "$p" ]; then echo "$p"; return; fi
        for p in "$(pyenv root)"/versions/3.12*/bin/python; do
            if [ -x "$p" ]; then echo "$p"; return; fi
        done
    fi
    for p in python3.12 python3.13 python3; do
        if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
            command -v "$p"; return
        fi
    done
    return 1
}

