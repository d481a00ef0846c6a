#!/bin/bash
# Oracle for sales-summary.
set -euo pipefail
{
  echo region,revenue
  awk -F, 'NR > 1 { s[$2] += $4 * $5 } END { for (r in s) printf "%s,%.2f\n", r, s[r] }' sales.csv | sort -t, -k2,2nr
} > summary.csv
