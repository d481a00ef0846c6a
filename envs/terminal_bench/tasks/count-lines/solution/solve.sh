#!/bin/bash
# Oracle for count-lines.
set -euo pipefail
wc -l < words.txt | tr -d ' ' > count.txt
