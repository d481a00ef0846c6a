#!/bin/bash
# Oracle for json-to-csv.
set -euo pipefail
python3 - <<'EOF'
import csv, json
with open("inventory.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(["name", "qty", "price"])
    for item in json.load(open("inventory.json")):
        w.writerow([item["name"], item["qty"], item["price"]])
EOF
