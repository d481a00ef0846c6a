#!/bin/bash
# Oracle for json-extract.
set -euo pipefail
python3 -c 'import json; print("\n".join(sorted(u["email"] for u in json.load(open("users.json")) if u["active"])))' > emails.txt
