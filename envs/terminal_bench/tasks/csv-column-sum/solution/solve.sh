#!/bin/bash
# Oracle for csv-column-sum.
set -euo pipefail
awk -F, 'NR > 1 { s += $3 } END { printf "%.2f\n", s }' sales.csv > total.txt
