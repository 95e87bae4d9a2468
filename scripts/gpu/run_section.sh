#!/usr/bin/env bash
# One section of the GPU check (scripts/gpu/gpu_check.sh): its command under `timeout`, then nothing of it left running:
#
#   bash scripts/gpu/run_section.sh LIMIT_S CMD...
#
# `timeout` signals its own process group only, and torchrun (accelerate launch with the multi-GPU or FSDP config)
# starts each worker in a session of its own, out of that group's reach: a launcher killed before it has ended its
# workers leaves them on the GPU through the sections after (and past the device call's end, which ends only the
# processes of its own session). So every process the command starts inherits a token in its environment, whichever
# session it moves to, and once the command has returned, ended or timed out, each process whose environment holds
# the token is killed (/proc/PID/environ: the environment a process started with).
# Exit status: the command's; 124 when it timed out, 137 when it ignored the TERM and was killed
# GPU_CHECK_KILL_AFTER_S seconds later (default 10).
set -uo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
    echo "error: usage: run_section.sh LIMIT_S CMD... (LIMIT_S a whole number of seconds; got: ${1:-nothing})" >&2
    exit 2
fi
limit=$1; shift
token="$$.$RANDOM$RANDOM.$(date +%s%N)"

GPU_CHECK_SECTION_ID=$token timeout -k "${GPU_CHECK_KILL_AFTER_S:-10}" "$limit" "$@"
rc=$?

# the processes still holding the token (this script and its grep never do: only the command's environment has it)
holders() { grep -lzxF "GPU_CHECK_SECTION_ID=$token" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3; }

# SIGKILL already pending: timeout's KILL to its group reached the process, which is on its way out. It was not
# left running, and counting it would make the message depend on how fast a loaded machine delivers the signal.
dying() {
    local key val
    while read -r key val; do
        case $key in SigPnd:|ShdPnd:) (( 0x$val & 0x100 )) && return 0 ;; esac
    done < "/proc/$1/status"
    return 1
} 2>/dev/null

declare -A ended=()
for _ in 1 2 3 4 5; do  # again: one may have started another before it was killed
    pids=$(holders)
    [ -n "$pids" ] || break
    for pid in $pids; do dying "$pid" || { kill -KILL "$pid" 2>/dev/null && ended[$pid]=1; }; done
    sleep 0.2
done
if [ ${#ended[@]} -gt 0 ]; then
    echo "run_section: killed ${#ended[@]} process(es) the section left running: ${!ended[*]}" >&2
fi
exit $rc
