#!/bin/bash
# Oracle for word-frequency.
set -euo pipefail
tr 'A-Z' 'a-z' < text.txt | grep -oE '[a-z]+' | sort | uniq -c | sort -rn | head -3 | awk '{print $2, $1}' > top3.txt
