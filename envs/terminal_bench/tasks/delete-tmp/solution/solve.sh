#!/bin/bash
# Oracle for delete-tmp.
set -euo pipefail
find cache -type f -name '*.tmp' -delete
