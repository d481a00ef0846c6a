#!/bin/bash
# Oracle for rename-by-pattern.
set -euo pipefail
cd photos
for f in IMG_*.jpeg; do
  digits=${f#IMG_}; digits=${digits%.jpeg}
  if [[ $digits =~ ^[0-9]+$ ]]; then mv -- "$f" "photo-$digits.jpg"; fi
done
