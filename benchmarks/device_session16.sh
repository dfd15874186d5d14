#!/usr/bin/env bash
# Session 16's name for benchmarks/device_calls.sh (the commands recorded in docs/BENCHMARKS.md use it).
exec bash "$(dirname "$0")/device_calls.sh" "$@"
