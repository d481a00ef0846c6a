#!/bin/bash
# Oracle for make-dirs.
set -euo pipefail
mkdir -p project/src/utils
: > project/src/utils/__init__.py
