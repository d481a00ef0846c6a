#!/bin/bash
# Oracle for find-large-files.
set -euo pipefail
find data -type f -size +1000c | LC_ALL=C sort > large.txt
