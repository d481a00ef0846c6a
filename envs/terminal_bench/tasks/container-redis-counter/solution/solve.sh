#!/bin/bash
# Oracle for container-redis-counter.
set -euo pipefail
redis-server --daemonize yes
for _ in $(seq 50); do redis-cli ping >/dev/null 2>&1 && break; sleep 0.1; done
redis-cli set visits 41 >/dev/null
redis-cli incr visits >/dev/null
redis-cli get visits > /app/visits.txt
