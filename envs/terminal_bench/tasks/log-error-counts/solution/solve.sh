#!/bin/bash
# Oracle for log-error-counts.
set -euo pipefail
awk '$2 == "ERROR" { sub(/:$/, "", $3); n[$3]++ } END { for (s in n) print s, n[s] }' app.log | sort -k2,2nr > errors.txt
