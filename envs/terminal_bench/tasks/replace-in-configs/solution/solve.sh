#!/bin/bash
# Oracle for replace-in-configs.
set -euo pipefail
find config -type f -name '*.conf' -exec sed -i 's/foo_v1/foo_v2/g' {} +
