#!/bin/bash
# Oracle for fix-unit-tests.
set -euo pipefail
python3 - <<'EOF'
src = open("calc.py").read()
src = src.replace("return a // b", "return a / b")
src = src.replace("range(1, n)", "range(1, n + 1)")
src = src.replace('cleaned = text.replace(" ", "")', 'cleaned = text.replace(" ", "").lower()')
open("calc.py", "w").write(src)
EOF
