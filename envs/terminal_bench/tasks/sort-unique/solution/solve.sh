#!/bin/bash
# Oracle for sort-unique.
set -euo pipefail
LC_ALL=C sort -u names.txt > sorted.txt
