#!/bin/bash
# Oracle for fix-median-bug.
set -euo pipefail
python3 - <<'EOF'
src = open("stats.py").read()
src = src.replace("    n = len(values)\n", "    values = sorted(values)\n    n = len(values)\n")
src = src.replace("    return values[mid]\n", "    if n % 2 == 0:\n        return (values[mid - 1] + values[mid]) / 2\n    return values[mid]\n")
open("stats.py", "w").write(src)
EOF
