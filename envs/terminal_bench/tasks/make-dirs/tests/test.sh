#!/bin/bash
# Verifier: writes 1 to /logs/verifier/reward.txt when project/src/utils/__init__.py exists and is empty, else 0.
mkdir -p /logs/verifier
if [ -d project/src/utils ] && [ -f project/src/utils/__init__.py ] && [ ! -s project/src/utils/__init__.py ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
