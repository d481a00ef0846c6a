#!/bin/bash
# Oracle for append-line.
set -euo pipefail
echo done >> log.txt
