#!/bin/bash
# Oracle for make-executable.
set -euo pipefail
chmod +x bin/*.sh
./bin/build.sh
