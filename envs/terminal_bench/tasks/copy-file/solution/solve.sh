#!/bin/bash
# Oracle for copy-file.
set -euo pipefail
mkdir -p backup
cp data/config.ini backup/config.ini
